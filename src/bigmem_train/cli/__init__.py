"""``bigmem-train``: plan, preflight, train, validate and report a 3D U-Net job.

The CLI layer: this module parses flags and turns errors into one line and an exit code;
:mod:`.commands` runs each command and :mod:`.output` formats what it prints; :mod:`.remote` is
``bigmem-train remote`` and :mod:`.slurm` ``bigmem-train slurm``. TensorFlow is imported only by the stages
that train.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from bigmem_train import __version__
from bigmem_train.cli import apply, commands
from bigmem_train.cli import remote as remote_cli
from bigmem_train.cli import slurm as slurm_cli
from bigmem_train.config import Config, FootprintConfig, load_config, parse_override
from bigmem_train.errors import BadInput, BigmemError
from bigmem_train.ops.hosts import DEFAULT_IMAGE

PROG = "bigmem-train"


def _add_config_flags(parser: argparse.ArgumentParser, target: bool = True) -> None:
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help="YAML job config (or a preset name: default, study); default: the built-in small job",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one config value, e.g. --set training.epochs=3 (repeatable)",
    )
    if target:
        parser.add_argument(
            "--target",
            metavar="SIZE",
            help="size the job to this peak memory: 64GiB, 1TB, 900GB or 80%% of the host",
        )


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    _add_config_flags(parser)
    parser.add_argument("--results", metavar="DIR", help="results folder (default: output.results_dir)")
    parser.add_argument(
        "--run-name",
        metavar="NAME",
        help="run directory name; rerunning an unfinished run of this name resumes it",
    )
    parser.add_argument("--data", metavar="DIR", help="Decathlon dataset folder (sets data.source=decathlon)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train the study's 3D U-Net on one big-memory host: plan its memory footprint, refuse "
        "a job that cannot fit, train, measure, validate and report. With no subcommand: `run` "
        "of the built-in default job.",
        epilog="Exit codes: 0 PASS, 1 the job ran but failed validation, 2 bad input, 3 does not fit this host.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="plan, preflight, train, validate and report (the default)",
        description="Plan, preflight, train, validate and report one job. With no config: "
        "synthesize a small dataset in the results folder and train the built-in default job.",
    )
    _add_run_flags(run)

    train = sub.add_parser(
        "train",
        help="plan, preflight and train, without validation or report",
        description="Plan, preflight and train one job; writes the run directory and metrics.json.",
    )
    _add_run_flags(train)

    validate = sub.add_parser(
        "validate",
        help="re-check a finished run from its files; exit 0 PASS, 1 FAIL",
        description="Re-check a finished run directory from its files alone: loss fell, "
        "validation Dice reached the floor, no NaN, peak memory within tolerance of the target.",
    )
    validate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (results/run-...)")

    report = sub.add_parser(
        "report",
        help="write an HTML report with plots for a run",
        description="Write RUN_DIR/report.html with PNG plots: memory over time, loss and Dice per epoch.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (results/run-...)")

    synth = sub.add_parser(
        "synth",
        help="write a synthetic dataset in the Decathlon layout",
        description="Write a synthetic MSD Task01-like dataset: dataset.json, imagesTr/*.nii.gz "
        "(4 contrasts) and labelsTr/*.nii.gz, head-like ellipsoids with tumour blobs.",
    )
    synth.add_argument("--out", required=True, metavar="DIR", help="dataset folder to create")
    synth.add_argument("--cases", type=int, default=16, metavar="N", help="number of cases (default 16)")
    synth.add_argument("--shape", default="64,64,48", metavar="X,Y,Z", help="volume shape (default 64,64,48)")
    synth.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")

    plan = sub.add_parser(
        "plan",
        help="predict the job's peak memory, or size it to a target",
        description="Print a breakdown of the predicted peak memory of a job, and with --target "
        "the input shape and batch size chosen to reach it.",
    )
    _add_config_flags(plan)
    plan.add_argument("--json", action="store_true", help="print JSON for scripts")
    plan.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's constants (runtime baseline, workspace) and store them",
    )

    preflight = sub.add_parser(
        "preflight",
        help="read the host and check the planned job fits",
        description="Read the host (memory, cgroup limit, NUMA, hugepages, swap) and check "
        "the planned job fits with the safety margin; exit 3 when it does not.",
    )
    _add_config_flags(preflight)
    preflight.add_argument("--json", action="store_true", help="print JSON for scripts")

    render = sub.add_parser(
        "render",
        help="render a config template from templates/ with this host's facts",
        description="Render one of the shared Jinja templates (the same ones Ansible uses) "
        "with this host's facts and optional variables.",
    )
    render.add_argument(
        "template", nargs="?", default="train.yaml.j2", help="template name (default train.yaml.j2)"
    )
    render.add_argument(
        "--var",
        dest="variables",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="template variable (repeatable)",
    )
    render.add_argument("--out", metavar="FILE", help="write here instead of stdout")
    render.add_argument("--list", action="store_true", help="list the templates")

    submit = sub.add_parser(
        "submit",
        help="submit the job to Slurm with its plan as the memory request",
        description="Plan the job, refuse it (exit 3) when fewer than --nodes of the partition's nodes can hold "
        "it (sinfo RealMemory), render templates/slurm_job.sh.j2 with --mem set to the plan's envelope "
        "peak plus the 3 % a run may end above it, over the memory guard's threshold (guard.threshold), and "
        "submit it with sbatch; prints the job id. A "
        "training.strategy multi_worker job runs on --nodes N nodes, one worker each started by srun, --mem "
        "one worker's plan. See docs/guides/slurm.md.",
    )
    _add_run_flags(submit)
    submit.add_argument(
        "--partition", metavar="NAME", help="Slurm partition (default: the cluster's default)"
    )
    submit.add_argument(
        "--time",
        metavar="LIMIT",
        help="time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED "
        "(default: the partition's)",
    )
    submit.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="N",
        help="nodes for the job (default 1; more than one needs training.strategy multi_worker: srun "
        "starts one worker per node, and --mem is one worker's plan)",
    )
    runner = submit.add_mutually_exclusive_group()
    runner.add_argument(
        "--image",
        nargs="?",
        const=DEFAULT_IMAGE,
        metavar="NAME",
        help=f"run the job in this Docker image on the node (default {DEFAULT_IMAGE}; the nodes must hold "
        "the image, and Docker on this host must know it)",
    )
    runner.add_argument(
        "--venv",
        action="store_true",
        help="run the job with this environment's bigmem-train, on storage the nodes share (the default)",
    )
    submit.add_argument(
        "--dry-run", action="store_true", help="print the batch script and the plan; submit nothing"
    )

    apply.add_parsers(sub)
    remote_cli.add_parser(sub)
    slurm_cli.add_parser(sub)
    return parser


def _overrides_and_origins(args: argparse.Namespace) -> tuple[dict, dict]:
    """The command line's config overrides, and how each was given (for the error that names one)."""
    overrides, origins = {}, {}
    for text in getattr(args, "overrides", []):
        key, value = parse_override(text)
        overrides[key], origins[key] = value, f"--set {text}"
    if getattr(args, "target", None):
        # Checked here so the message names the flag, not the config file it overrides.
        try:
            FootprintConfig(target=args.target)
        except ValidationError as error:
            message = error.errors()[0]["msg"].removeprefix("Value error, ")
            raise BadInput(f"--target {args.target}: {message}") from None
        overrides["footprint.target"], origins["footprint.target"] = args.target, f"--target {args.target}"
    if getattr(args, "results", None):
        overrides["output.results_dir"], origins["output.results_dir"] = (
            args.results,
            f"--results {args.results}",
        )
    if getattr(args, "run_name", None):
        overrides["output.run_name"], origins["output.run_name"] = (
            args.run_name,
            f"--run-name {args.run_name}",
        )
    if getattr(args, "data", None):
        overrides["data.source"] = "decathlon"
        overrides["data.path"] = args.data
        origins["data.source"] = origins["data.path"] = f"--data {args.data}"
    return overrides, origins


def load_job_config(args: argparse.Namespace) -> Config:
    overrides, origins = _overrides_and_origins(args)
    return load_config(args.config, overrides, origins)


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None
    argv = sys.argv[1:] if argv is None else argv
    # TensorFlow's C++ start-up chatter (CUDA probes on a CPU host) hides the job's own output.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in {"-h", "--help", "--version"}:
        argv = ["run", *argv]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        # argparse exits 2 on bad flags already, 0 on --help.
        return int(exit_.code or 0)
    try:
        return dispatch(args)
    except BigmemError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        run_dir = getattr(error, "run_dir", None)
        if as_program and run_dir is not None:
            # A run stopped for memory leaves at once, everything written: TensorFlow's teardown takes
            # seconds, in which memory that kept growing can still bring the OOM killer (issue 41, item 15).
            from bigmem_train.verdict.rundir import STOPPED, set_state

            set_state(run_dir, STOPPED, leaving=False)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(error.exit_code)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _submit(args: argparse.Namespace) -> int:
    """``bigmem-train submit``: the job's own ``run`` flags, made absolute, go into the batch script."""
    from bigmem_train.ops.scheduler import RunFlags, check_time, submit_job

    if args.time:
        check_time(args.time)  # before the plan: a typo costs nothing
    if not args.run_name:
        args.run_name = time.strftime("run-%Y%m%d-%H%M%S")
    config = load_job_config(args)
    given = Path(args.config) if args.config else None
    flags = RunFlags(
        config=str(given.resolve()) if given and given.exists() else args.config,
        overrides=tuple(args.overrides),
        target=args.target,
        data=str(Path(args.data).resolve()) if args.data else None,
        results=str(Path(config.output.results_dir).resolve()),
        run_name=args.run_name,
    )
    return submit_job(
        config, flags, args.partition, args.time, args.dry_run, nodes=args.nodes, image=args.image
    )


def dispatch(args: argparse.Namespace) -> int:
    command = args.command
    if command in {"run", "train"}:
        return commands.run_command(load_job_config(args), validate_and_report=command == "run")
    if command == "validate":
        return commands.validate_command(Path(args.run_dir))
    if command == "report":
        return commands.report_command(Path(args.run_dir))
    if command == "synth":
        return commands.synth_command(Path(args.out), args.cases, args.shape, args.seed)
    if command == "plan":
        return commands.plan_command(load_job_config(args), as_json=args.json, calibrate_first=args.calibrate)
    if command == "preflight":
        return commands.preflight_command(load_job_config(args), as_json=args.json)
    if command == "render":
        return commands.render_command(args)
    if command == "predict":
        return apply.predict_command(args)
    if command == "evaluate":
        return apply.evaluate_command(args)
    if command == "remote":
        return remote_cli.dispatch(args)
    if command == "submit":
        return _submit(args)
    if command == "slurm":
        return slurm_cli.dispatch(args)
    raise BadInput(f"unknown command {command!r}")
