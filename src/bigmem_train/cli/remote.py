"""`bigmem-train remote ...`: run and watch jobs on lab servers over SSH (Fabric; see remote.py).

Hosts, users, ports and keys come from an Ansible inventory (default ``inventory.ini``), so the file
that drives ``ansible-playbook`` drives these commands too.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bigmem_train.cli.apply import add_predict_options, predict_option_flags
from bigmem_train.errors import BadInput
from bigmem_train.ops import remote, remote_predict
from bigmem_train.ops.hosts import DEFAULT_IMAGE

DEFAULT_INVENTORY_ENV = "BIGMEM_TRAIN_INVENTORY"

EPILOG = (
    "Exit codes: 0 done, 2 bad input (unknown host or group, no such job, bad config or name, "
    "a path that is not on the host), "
    "4 the host is unreachable or refuses the login. See docs/guides/remote-and-scale-out.md."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--inventory",
        "-i",
        metavar="FILE",
        default=os.environ.get(DEFAULT_INVENTORY_ENV, "inventory.ini"),
        help=f"Ansible inventory (default: ${DEFAULT_INVENTORY_ENV} or inventory.ini)",
    )
    common.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="give up on a host that does not answer within this time (default 10)",
    )

    remote = sub.add_parser(
        "remote",
        help="start, watch, stop and fetch jobs on lab servers over SSH",
        description="Operate jobs on the inventory's servers over SSH (Fabric): start a "
        "detached job, read its status from the run's files, follow its log, stop it and "
        "fetch its run directory.",
        epilog=EPILOG,
    )
    actions = remote.add_subparsers(dest="remote_command", metavar="ACTION")

    start = actions.add_parser(
        "start",
        parents=[common],
        epilog=EPILOG,
        help="copy a config to a host and start the job detached",
        description="Copy the config to the host and start the job detached: a named "
        "hardened container (`docker run -d`), or with --no-docker the host's bigmem-train "
        "in its own session. TARGET is a host, or for training.strategy multi_worker the "
        "inventory group whose hosts are the workers (TF_CONFIG rendered per host). "
        "Starting a stopped job's name again resumes it.",
    )
    start.add_argument("target", metavar="TARGET", help="inventory host (or group, for multi_worker)")
    start.add_argument(
        "--config", "-c", required=True, metavar="FILE", help="job config (YAML) or preset name"
    )
    start.add_argument("--name", metavar="NAME", help="job and container name (default bigmem-DATE-TIME)")
    start.add_argument("--image", default=DEFAULT_IMAGE, help=f"container image (default {DEFAULT_IMAGE})")
    start.add_argument(
        "--no-docker",
        action="store_true",
        help="run the host's bigmem-train (bigmem_train_executable) instead of a container",
    )
    start.add_argument(
        "--data", metavar="HOST_DIR", help="Decathlon dataset folder on the host (mounted read-only)"
    )

    predict = actions.add_parser(
        "predict",
        parents=[common],
        epilog=EPILOG,
        help="segment images on a host with a model there (then evaluate), detached",
        description="Start `bigmem-train predict` detached on HOST, on images and with a model that "
        "are already there: --model a run directory on the host, or --job the run of a training job "
        "started there with `remote start`. With --labels, `evaluate` scores the masks in the same job "
        "once predict has succeeded. The masks, predict.json and evaluation.* go to the job's "
        "results/NAME; status, logs, stop and fetch NAME work as for a training job. Paths on the host "
        "are absolute or relative to the login's home; each is checked there before the job starts. "
        "In a container (the default) the model, images and labels are mounted read-only, with no "
        "network.",
    )
    # Not "target": predict's --target (a memory size) is that option's.
    predict.add_argument("host", metavar="HOST", help="inventory host")
    predict.add_argument(
        "--model", metavar="HOST_PATH", help="a run directory on the host (or RUN/checkpoints/X.keras)"
    )
    predict.add_argument(
        "--job", metavar="JOB", help="instead of --model: the run directory of training job JOB on HOST"
    )
    predict.add_argument(
        "--data",
        required=True,
        metavar="HOST_PATH",
        help="a NIfTI image, a folder of them, or a Decathlon folder (its dataset.json's --subset) on the host",
    )
    predict.add_argument(
        "--labels", metavar="HOST_DIR", help="evaluate the masks against this label folder on the host"
    )
    predict.add_argument("--name", metavar="NAME", help="job and container name (default predict-DATE-TIME)")
    predict.add_argument("--image", default=DEFAULT_IMAGE, help=f"container image (default {DEFAULT_IMAGE})")
    predict.add_argument(
        "--no-docker",
        action="store_true",
        help="run the host's bigmem-train (bigmem_train_executable) instead of a container",
    )
    add_predict_options(predict)

    status = actions.add_parser(
        "status",
        parents=[common],
        epilog=EPILOG,
        help="running or not, epoch and step, live and peak memory",
        description="Read the job's own files on the host: state, current epoch and "
        "step, the last epoch's loss and Dice, live and peak memory, the verdict.",
    )
    status.add_argument("target", metavar="TARGET", help="inventory host (or group: every worker)")
    status.add_argument("name", metavar="NAME")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")

    logs = actions.add_parser(
        "logs",
        parents=[common],
        epilog=EPILOG,
        help="print (or follow) a job's output",
        description="Print the job's output; with --follow keep printing until it ends.",
    )
    logs.add_argument("host", metavar="HOST")
    logs.add_argument("name", metavar="NAME")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    logs.add_argument("--lines", "-n", type=int, metavar="N", help="only the last N lines")

    stop = actions.add_parser(
        "stop",
        parents=[common],
        epilog=EPILOG,
        help="stop a job (it stays resumable)",
        description="SIGTERM the job (container or process group), SIGKILL after the "
        "grace period. Its run directory stays; start the same name again to resume.",
    )
    stop.add_argument("target", metavar="TARGET", help="inventory host (or group: every worker)")
    stop.add_argument("name", metavar="NAME")
    stop.add_argument(
        "--grace", type=int, default=30, metavar="SECONDS", help="wait before SIGKILL (default 30)"
    )

    fetch = actions.add_parser(
        "fetch",
        parents=[common],
        epilog=EPILOG,
        help="copy a job's run directory (verdict, report, metrics) here",
        description="Copy the job's run directory (without the transient backup/) and "
        "its log to DIR/RUN_NAME over SFTP.",
    )
    fetch.add_argument("host", metavar="HOST")
    fetch.add_argument("name", metavar="NAME")
    fetch.add_argument("--to", required=True, metavar="DIR", help="local folder to copy into")
    fetch.add_argument(
        "--no-checkpoints", action="store_true", help="leave the model checkpoints on the host"
    )

    tf_config = actions.add_parser(
        "tf-config",
        parents=[common],
        epilog=EPILOG,
        help="print TF_CONFIG for one worker host of a group",
        description="Render templates/tf_config.json.j2 for HOST from the inventory, "
        "as Ansible's train role does.",
    )
    tf_config.add_argument("host", metavar="HOST")
    tf_config.add_argument(
        "--group", metavar="GROUP", help="the workers' group (default: the host's one group)"
    )

    actions.add_parser("hosts", parents=[common], help="list the inventory's hosts as SSH will reach them")


def dispatch(args: argparse.Namespace) -> int:
    action = getattr(args, "remote_command", None)
    if action is None:
        raise BadInput(
            "remote: give an action: start, predict, status, logs, stop, fetch, tf-config, hosts "
            "(see bigmem-train remote --help)"
        )
    inventory = remote.load_inventory(args.inventory)
    timeout = args.connect_timeout
    if action == "start":
        name = args.name or remote.default_job_name()
        request = remote.StartRequest(
            config=args.config, name=name, image=args.image, docker=not args.no_docker, data_dir=args.data
        )
        for job in remote.start(inventory, args.target, request, timeout):
            print(
                f"started {name} on {job['host']} ({_how(job)}); run directory "
                f"{remote.job_dir(inventory.host(job['host']), name)}/{job['run_dir']}"
            )
        return 0
    if action == "predict":
        name = args.name or time.strftime("predict-%Y%m%d-%H%M%S")
        predict_request = remote_predict.PredictJobRequest(
            name=name,
            data=args.data,
            model=args.model,
            job=args.job,
            labels=args.labels,
            image=args.image,
            docker=not args.no_docker,
            predict_flags=predict_option_flags(args),
        )
        job = remote_predict.predict(inventory, args.host, predict_request, timeout)
        then = " then evaluate" if job["labels"] else ""
        print(
            f"started {name} on {job['host']} ({_how(job)}): predict{then} with {job['model']}; "
            f"results {remote.job_dir(inventory.host(job['host']), name)}/{job['run_dir']}"
        )
        return 0
    if action == "status":
        reports = remote.status(inventory, args.target, args.name, timeout)
        if args.json:
            print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
        else:
            print("\n".join(remote.format_status(report) for report in reports))
        return 0
    if action == "logs":
        return remote.logs(
            inventory, args.host, args.name, follow=args.follow, lines=args.lines, timeout=timeout
        )
    if action == "stop":
        for message in remote.stop(inventory, args.target, args.name, args.grace, timeout):
            print(message)
        return 0
    if action == "fetch":
        destination = remote.fetch(
            inventory, args.host, args.name, args.to, checkpoints=not args.no_checkpoints, timeout=timeout
        )
        verdict, predicted = destination / "verdict.json", destination / "predict.json"
        summary = ""
        if verdict.is_file():
            summary = f"; verdict {json.loads(verdict.read_text()).get('verdict')}"
        elif predicted.is_file():
            summary = f"; {len(json.loads(predicted.read_text()).get('cases', {}))} mask(s)"
            if (destination / "evaluation.json").is_file():
                summary += ", evaluation.json"
        print(f"fetched {destination}{summary}")
        return 0
    if action == "tf-config":
        print(remote.tf_config(inventory, args.host, args.group))
        return 0
    if action == "hosts":
        for host in inventory.hosts.values():
            key = f" key {host.key_file}" if host.key_file else ""
            print(
                f"{host.name}: {host.user + '@' if host.user else ''}{host.address}:{host.port}{key} "
                f"dir {host.remote_dir}"
            )
        return 0
    raise BadInput(f"remote: unknown action {action!r}")


def _how(job: dict) -> str:
    return (
        f"container {job.get('container_id', job['name'])}"
        if job["mode"] == "docker"
        else f"pid {job['pid']}"
    )
