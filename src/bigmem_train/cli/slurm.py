"""`bigmem-train slurm ...`: watch, stop and fetch the jobs `bigmem-train submit` gave to Slurm.

The Slurm twin of `bigmem-train remote status|logs|stop|fetch`: a job is named by its Slurm job id or
its run name, Slurm says its state, and the run directory on the shared results folder says the rest.
`slurm tf-config` is the twin of `remote tf-config`: each worker of a multi-node job runs it, inside the job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bigmem_train.errors import BadInput
from bigmem_train.ops import scheduler

EPILOG = (
    "Exit codes: 0 done, 2 bad input (no such job, a job not made by submit, Slurm not installed or "
    "not answering). See docs/guides/slurm.md."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("job", metavar="JOB", help="Slurm job id, or run name (its newest job)")
    common.add_argument(
        "--results",
        metavar="DIR",
        default="results",
        help="the results folder the job was submitted with; needed only once Slurm no longer "
        "lists the job (default: results)",
    )

    slurm = sub.add_parser(
        "slurm",
        help="watch, stop and fetch jobs submitted to Slurm",
        description="Operate the jobs `bigmem-train submit` gave to Slurm: their state (Slurm's and the "
        "run's), their output, scancel, and a copy of their run directory; and, inside a multi-node job, "
        "a worker's TF_CONFIG.",
        epilog=EPILOG,
    )
    actions = slurm.add_subparsers(dest="slurm_command", metavar="ACTION")

    status = actions.add_parser(
        "status",
        parents=[common],
        epilog=EPILOG,
        help="Slurm's state, epoch and step, memory, the verdict",
        description="Slurm's state of the job (reason while pending, node, exit code once ended) and "
        "what its run directory says: epoch and step, the last epoch's loss and Dice, memory, the verdict.",
    )
    status.add_argument("--json", action="store_true", help="print JSON for scripts")

    logs = actions.add_parser(
        "logs",
        parents=[common],
        epilog=EPILOG,
        help="print (or follow) a job's output",
        description="Print the job's output file (RESULTS/NAME.slurm-JOBID.out); with --follow keep "
        "printing until Slurm says the job ended.",
    )
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--lines", "-n", type=int, metavar="N", help="only the last N lines")

    actions.add_parser(
        "stop",
        parents=[common],
        epilog=EPILOG,
        help="scancel a job (it stays resumable)",
        description="scancel the job (Slurm sends SIGTERM, then SIGKILL after its KillWait) and wait for "
        "it to end. Its run directory stays; submit the same config and --run-name again to resume.",
    )

    fetch = actions.add_parser(
        "fetch",
        parents=[common],
        epilog=EPILOG,
        help="copy a job's run directory (verdict, report, metrics) here",
        description="Copy the job's run directory (without the transient backup/) and its output "
        "(as job.log) to DIR/RUN_NAME.",
    )
    fetch.add_argument("--to", required=True, metavar="DIR", help="local folder to copy into")
    fetch.add_argument("--no-checkpoints", action="store_true", help="leave the model checkpoints out")

    actions.add_parser(
        "tf-config",
        epilog="Exit codes: 0 printed, 2 bad input (not in a task srun started, more than one task on a "
        "node, scontrol not answering). See docs/guides/slurm.md.",
        help="print TF_CONFIG for this worker of a multi-node job (run by srun, in the job)",
        description="Print TF_CONFIG for the task of a multi-node job this runs in, from Slurm's "
        "environment: the step's nodes (scontrol show hostnames SLURM_STEP_NODELIST) at their NodeAddr, "
        f"a port from the job id ({scheduler.WORKER_PORT_BASE} + the id modulo {scheduler.WORKER_PORT_SPAN}), "
        "and SLURM_PROCID as the worker's index. The batch script of `submit --nodes N` runs it in each "
        "worker before `bigmem-train run`.",
    )


def dispatch(args: argparse.Namespace) -> int:
    action = getattr(args, "slurm_command", None)
    if action is None:
        raise BadInput(
            "slurm: give an action: status, logs, stop, fetch, tf-config (see bigmem-train slurm --help)"
        )
    if action == "tf-config":
        print(scheduler.slurm_tf_config())
        return 0
    job = scheduler.find_job(args.job, Path(args.results))
    if action == "status":
        report = scheduler.job_status(job)
        print(json.dumps(report, indent=2) if args.json else scheduler.format_job_status(report))
        return 0
    if action == "logs":
        return scheduler.job_logs(job, follow=args.follow, lines=args.lines)
    if action == "stop":
        print(scheduler.stop_job(job))
        return 0
    if action == "fetch":
        destination = scheduler.fetch_job(job, Path(args.to), checkpoints=not args.no_checkpoints)
        verdict = destination / "verdict.json"
        summary = f"; verdict {json.loads(verdict.read_text()).get('verdict')}" if verdict.is_file() else ""
        print(f"fetched {destination}{summary}")
        return 0
    raise BadInput(f"slurm: unknown action {action!r}")
