"""Fabric tasks: start, watch, stop and fetch jobs on lab servers over SSH, hosts from inventory.ini.

The inventory is read with Ansible's own parser, so ``ansible_host``, ``ansible_user``,
``ansible_port`` and ``ansible_ssh_private_key_file`` mean exactly what they mean to
``ansible-playbook``. Everything on the server is plain files under one folder per job, read by
``sh``, ``awk`` and ``tail``: the server needs no Python of its own for a containerised job.

Layout on a host (``REMOTE_DIR`` is the host's ``bigmem_train_remote_dir``, default
``bigmem-train`` in the login's home)::

    REMOTE_DIR/jobs/NAME/
      config.yaml     the job's config, as given
      job.json        how it was started: command (run | predict), mode (docker | process), image or
                      pid, run directory
      job.log         output of a process-mode job (a container's output is in `docker logs`)
      exit_code       written when a process-mode job ends
      results/RUN/    the run directory (state.json, progress.json, history.csv, steps.csv, memory.csv, ...)

A ``remote predict`` job (remote_predict.py) keeps the same files, its masks in ``results/NAME/``.

Exit codes: 2 bad input (unknown host, no such job, bad config or name); 4 the host cannot be
reached or refuses the login (as ``ansible-playbook`` uses 4 for unreachable hosts).
"""

from __future__ import annotations

import json
import shlex
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigmem_train.config import PRESETS_DIR, load_config
from bigmem_train.errors import BadInput
from bigmem_train.ops.distribute import (
    parse_tf_config,
    per_worker_batch_size,
    render_tf_config,
    worker_run_name,
)
from bigmem_train.ops.hosts import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_IMAGE,
    EXIT_UNREACHABLE,
    Inventory,
    RemoteHost,
    Unreachable,
    _put_text,
    _run,
    check_job_name,
    connect,
    default_job_name,
    job_dir,
    load_inventory,
)
from bigmem_train.ops.status import _is_running, _read_job, format_status, status
from bigmem_train.verdict.rundir import FINISHED

# What `bigmem-train remote` and its callers use from this module, wherever it is defined.
__all__ = [
    "EXIT_UNREACHABLE",
    "HARDENED_DOCKER_FLAGS",
    "Inventory",
    "RemoteHost",
    "StartRequest",
    "Unreachable",
    "check_job_name",
    "check_name_free",
    "check_runner",
    "default_job_name",
    "detached",
    "docker_run_command",
    "docker_run_head",
    "fetch",
    "format_status",
    "job_dir",
    "launch",
    "load_inventory",
    "logs",
    "prepare_job_folder",
    "process_command",
    "start",
    "status",
    "stop",
    "tf_config",
]


# `docker run` hardening, as the Ansible train role runs the job: no capabilities, no privilege gain,
# no writes outside /results and /tmp, the caller's uid so results belong to the login. No network,
# unless the job is multi-worker.
HARDENED_DOCKER_FLAGS = [
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--read-only",
    "--tmpfs",
    "/tmp:rw,nosuid,nodev",
    "--pids-limit",
    "4096",
    "--ipc",
    "private",
]


def _config_text(config: str) -> str:
    """The config file's text after checking it locally (exit 2 before anything touches the host)."""
    load_config(config)
    path = Path(config)
    if not path.exists() and (PRESETS_DIR / f"{config}.yaml").is_file():
        path = PRESETS_DIR / f"{config}.yaml"
    return path.read_text()


@dataclass
class StartRequest:
    config: str
    name: str
    image: str = DEFAULT_IMAGE
    docker: bool = True
    data_dir: str | None = None


def start(
    inventory: Inventory, target: str, request: StartRequest, timeout: float = DEFAULT_CONNECT_TIMEOUT
) -> list[dict[str, Any]]:
    """Start a job detached on a host, or on every host of a group for a multi-worker job."""
    check_job_name(request.name)
    config_text = _config_text(request.config)
    config = load_config(request.config)
    hosts = inventory.targets(target)
    multi_worker = config.training.strategy == "multi_worker"
    tf_configs: list[str | None] = [None] * len(hosts)
    if multi_worker:
        group = target if target in inventory.groups else None
        if group is None:
            raise BadInput(
                f"training.strategy multi_worker runs one worker per host of an inventory group; "
                f"{target} is a host, give its group"
            )
        per_worker_batch_size(config, len(hosts))
        tf_configs = [
            render_tf_config(inventory.groups, inventory.hostvars(), host.name, group) for host in hosts
        ]
    elif len(hosts) > 1:
        raise BadInput(
            f"{target} is a group of {len(hosts)} hosts; a job with training.strategy single "
            f"runs on one host (name the host, or set training.strategy: multi_worker)"
        )
    started = []
    for host, tf_config in zip(hosts, tf_configs):
        # Every worker runs with the job's name; `run` names a non-chief's run directory NAME.workerN.
        run_name = request.name
        if tf_config:
            run_name = worker_run_name(request.name, parse_tf_config(tf_config))
        with connect(host, timeout) as connection:
            started.append(_start_on(connection, host, request, config_text, run_name, tf_config))
    return started


def _start_on(
    connection: Any,
    host: RemoteHost,
    request: StartRequest,
    config_text: str,
    run_name: str,
    tf_config: str | None,
) -> dict[str, Any]:
    name = request.name
    folder = job_dir(host, name)
    check_name_free(connection, host, name, "run")
    check_runner(connection, host, request.docker)
    prepare_job_folder(connection, host, folder)
    _put_text(connection, config_text, f"{folder}/config.yaml")
    job: dict[str, Any] = {
        "name": name,
        "command": "run",
        "mode": "docker" if request.docker else "process",
        "host": host.name,
        "run_dir": f"results/{run_name}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "multi_worker": tf_config is not None,
    }
    environment = {"TF_CONFIG": tf_config} if tf_config else {}
    if request.docker:
        job.update(image=request.image, container=name)
        nodes = _run(
            connection, "ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l"
        ).stdout.strip()
        command = docker_run_command(
            name,
            request.image,
            folder,
            name,
            request.data_dir,
            environment,
            numa_nodes=int(nodes) if nodes.isdigit() else 1,
        )
    else:
        command = process_command(host.executable, name, request.data_dir, environment)
    job.update(launch(connection, host, folder, name, request.docker, command))
    _put_text(connection, json.dumps(job, indent=2) + "\n", f"{folder}/job.json")
    return job


# What each kind of job is called in messages; job.json's "command" (absent before predict jobs: "run").
JOB_KINDS = {"run": "training", "predict": "predict"}


def check_name_free(connection: Any, host: RemoteHost, name: str, command: str) -> None:
    """Refuse a job name that is running, or that belongs to a job of the other kind (a training run and
    predictions would share one results folder), or a training job whose run finished (a finished run is
    kept as it is). A stopped or failed training job is resumed under its name; a predict job may be rerun."""
    existing = _read_job(connection, host, name, required=False)
    if existing is None:
        return
    if _is_running(connection, existing):
        raise BadInput(
            f"job {name} is already running on {host.name}; stop it first or choose another --name"
        )
    kind = existing.get("command", "run")
    if kind != command:
        raise BadInput(
            f"job {name} on {host.name} is a {JOB_KINDS.get(kind, kind)} job; choose another --name"
        )
    if kind == "run" and existing.get("run_dir"):
        # A finished run is never overwritten (`run` refuses it inside the job): say so before launching.
        state = _run(
            connection, f"cat {shlex.quote(existing['folder'])}/{shlex.quote(existing['run_dir'])}/state.json"
        )
        try:
            finished = json.loads(state.stdout).get("state") == FINISHED if state.exited == 0 else False
        except (json.JSONDecodeError, AttributeError):
            finished = False
        if finished:
            raise BadInput(
                f"job {name} on {host.name} already finished (its run {existing['run_dir']} is kept as it "
                f"is); fetch it, or choose another --name"
            )


def check_runner(connection: Any, host: RemoteHost, docker: bool) -> None:
    """Docker, or for --no-docker the host's bigmem-train, is there (BadInput naming the fix otherwise)."""
    if docker:
        if _run(connection, "command -v docker").exited != 0:
            raise BadInput(
                f"docker is not installed on {host.name} (provision it with the docker role, "
                f"or start the job with --no-docker)"
            )
    elif _run(connection, f"command -v {shlex.quote(host.executable)}").exited != 0:
        raise BadInput(
            f"{host.executable} is not on {host.name}'s PATH (install bigmem-train there, or set "
            f"bigmem_train_executable in the inventory)"
        )


def prepare_job_folder(connection: Any, host: RemoteHost, folder: str) -> None:
    """The job's folder with its results/, without the exit code of an earlier run of the same name."""
    made = _run(
        connection, f"mkdir -p {shlex.quote(folder)}/results && rm -f {shlex.quote(folder)}/exit_code"
    )
    if made.exited != 0:
        raise BadInput(f"cannot create {folder} on {host.name}: {made.stderr.strip()}")


def launch(
    connection: Any, host: RemoteHost, folder: str, name: str, docker: bool, command: str
) -> dict[str, Any]:
    """Run a job's start command in its folder: job.json's container_id (docker) or pid (process)."""
    if docker:
        result = _run(
            connection,
            f"cd {shlex.quote(folder)} && (docker rm -f {shlex.quote(name)} >/dev/null 2>&1; {command})",
        )
        if result.exited != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("docker:")] or [
                result.stderr
            ]
            raise BadInput(f"docker run failed on {host.name}: {errors[0].strip()}")
        return {"container_id": result.stdout.strip()[:12]}
    # Not `cd && job &`: that would background the list, whose shell holds the SSH channel open.
    result = _run(connection, f"cd {shlex.quote(folder)} || exit 1\n{command}")
    pid = result.stdout.strip()
    if result.exited != 0 or not pid.isdigit():
        raise BadInput(f"could not start {host.executable} on {host.name}: {result.stderr.strip()}")
    return {"pid": int(pid)}


def docker_run_head(name: str, results: str = '"$PWD/results"', detach: bool = True) -> list[str]:
    """The start of every job's `docker run` (training and predict; detached on a remote host, in the
    foreground in a Slurm batch script): the container named after the job, the login's uid, the hardening
    flags, the job's results folder (``results``, a shell word; default results/ of the job's folder)
    writable at /results."""
    return [
        "docker",
        "run",
        *(["-d"] if detach else []),
        "--name",
        shlex.quote(name),
        "--user",
        '"$(id -u):$(id -g)"',
        *HARDENED_DOCKER_FLAGS,
        "-v",
        f"{results}:/results",
    ]


def docker_run_command(
    name: str,
    image: str,
    folder: str,
    run_name: str,
    data_dir: str | None,
    environment: dict[str, str],
    numa_nodes: int = 1,
    *,
    config: str | None = '"$PWD/config.yaml"',
    results: str = '"$PWD/results"',
    detach: bool = True,
    options: Sequence[str] = (),
    run_flags: Sequence[str] = (),
) -> str:
    """`docker run` of one training job: hardened, results and config mounted (by default from the job's
    folder on a remote host, detached). ``config``: a shell word for the config file, mounted read-only at
    /config/job.yaml (None: no file; ``run_flags`` may then name a preset). ``options``: more `docker run`
    flags, as shell words; ``run_flags``: more flags of the job's `bigmem-train run` (``--set``, ...)."""
    quote = shlex.quote
    parts = [*docker_run_head(name, results, detach)]
    if config is not None:
        parts += ["-v", f"{config}:/config/job.yaml:ro"]
    if data_dir:
        parts += ["-v", f"{quote(data_dir)}:/data:ro"]
    # The workers of a multi-worker job reach each other on the ports TF_CONFIG names.
    parts += ["--network", "host" if environment.get("TF_CONFIG") else "none"]
    if numa_nodes > 1:
        # numactl binds memory and cores to NUMA nodes (the planner's placement).
        parts += ["--cap-add", "SYS_NICE"]
    for key, value in environment.items():
        parts += ["-e", quote(f"{key}={value}")]
    parts += [*options, quote(image), "run"]
    if config is not None:
        parts += ["--config", "/config/job.yaml"]
    parts += [*(quote(flag) for flag in run_flags), "--results", "/results", "--run-name", quote(run_name)]
    if data_dir:
        parts += ["--data", "/data"]
    return " ".join(parts)


def process_command(executable: str, run_name: str, data_dir: str | None, environment: dict[str, str]) -> str:
    """Start bigmem-train detached in its own session (so `stop` can end the whole process group)."""
    quote = shlex.quote
    job = [executable, "run", "--config", "config.yaml", "--results", "results", "--run-name", run_name]
    if data_dir:
        job += ["--data", data_dir]
    return detached(" ".join(quote(part) for part in job), environment)


def detached(script: str, environment: dict[str, str] | None = None) -> str:
    """``script`` (shell) started detached in its own session, its output in job.log.

    The shell that waits for it writes the exit code; its pid, printed, is the session's id.
    """
    quote = shlex.quote
    inner = f"{script}; echo $? > exit_code"
    exports = "".join(f"{key}={quote(value)} " for key, value in (environment or {}).items())
    return f"{exports}setsid nohup sh -c {quote(inner)} > job.log 2>&1 < /dev/null & echo $!"


def logs(
    inventory: Inventory,
    host_name: str,
    name: str,
    follow: bool = False,
    lines: int | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> int:
    """Print a job's output; with ``follow``, keep printing until the job ends (or Ctrl-C)."""
    host = inventory.host(host_name)
    with connect(host, timeout) as connection:
        job = _read_job(connection, host, name)
        if job.get("mode") == "docker":
            command = [
                "docker",
                "logs",
                *(["--follow"] if follow else []),
                *(["--tail", str(lines)] if lines is not None else []),
                job["container"],
            ]
        else:
            command = ["tail", "-n", str(lines) if lines is not None else "+1"]
            if follow:
                # tail stops following when the job's shell exits.
                command += ["-F", f"--pid={int(job['pid'])}"]
            command.append(f"{job['folder']}/job.log")
        result = _run(connection, " ".join(shlex.quote(part) for part in command), stream=True)
        sys.stdout.flush()
        return 0 if result.exited == 0 else 1


def stop(
    inventory: Inventory,
    target: str,
    name: str,
    grace_seconds: int = 30,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> list[str]:
    """Stop a job (every worker of a group): SIGTERM, then SIGKILL after ``grace_seconds``.

    The run stays resumable: starting a job of the same name again continues from its last epoch.
    """
    messages = []
    for host in inventory.targets(target):
        with connect(host, timeout) as connection:
            job = _read_job(connection, host, name)
            if not _is_running(connection, job):
                messages.append(f"{name} on {host.name}: not running")
                continue
            if job.get("mode") == "docker":
                result = _run(
                    connection, f"docker stop -t {int(grace_seconds)} {shlex.quote(job['container'])}"
                )
                if result.exited != 0:
                    raise BadInput(f"docker stop failed on {host.name}: {result.stderr.strip()}")
            else:
                group = int(job["pid"])
                _run(
                    connection,
                    f"kill -TERM -- -{group} 2>/dev/null; i=0; "
                    f"while kill -0 {group} 2>/dev/null && [ $i -lt {int(grace_seconds) * 10} ]; "
                    f"do sleep 0.1; i=$((i+1)); done; kill -KILL -- -{group} 2>/dev/null; true",
                )
            saved = {key: value for key, value in job.items() if key != "folder"}
            saved.update(stopped=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            _put_text(connection, json.dumps(saved, indent=2) + "\n", f"{job['folder']}/job.json")
            messages.append(f"{name} on {host.name}: stopped")
    return messages


def fetch(
    inventory: Inventory,
    host_name: str,
    name: str,
    to_dir: str | Path,
    checkpoints: bool = True,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> Path:
    """Copy a job's run directory (without the transient backup/) and its log into ``to_dir``."""
    host = inventory.host(host_name)
    destination_root = Path(to_dir).expanduser()
    with connect(host, timeout) as connection:
        job = _read_job(connection, host, name)
        remote_run = f"{job['folder']}/{job['run_dir']}"
        sftp = connection.sftp()
        try:
            sftp.stat(remote_run)
        except FileNotFoundError:
            raise BadInput(f"job {name} on {host.name} has no run directory yet ({remote_run})") from None
        destination = destination_root / Path(job["run_dir"]).name
        skip = {"backup"} | (set() if checkpoints else {"checkpoints"})
        _download_tree(sftp, remote_run, destination, skip)
        if job.get("mode") == "docker":
            result = _run(connection, f"docker logs {shlex.quote(job['container'])} 2>&1")
            if result.exited == 0:
                (destination / "job.log").write_text(result.stdout)
        else:
            try:
                sftp.get(f"{job['folder']}/job.log", str(destination / "job.log"))
            except FileNotFoundError:
                pass
    return destination


def _download_tree(sftp: Any, remote: str, local: Path, skip: set[str]) -> None:
    local.mkdir(parents=True, exist_ok=True)
    for entry in sftp.listdir_attr(remote):
        if entry.filename in skip or entry.filename.startswith(".") and entry.filename.endswith(".tmp"):
            continue
        source = f"{remote}/{entry.filename}"
        if stat.S_ISDIR(entry.st_mode or 0):
            _download_tree(sftp, source, local / entry.filename, set())
        elif stat.S_ISREG(entry.st_mode or 0):
            sftp.get(source, str(local / entry.filename))


def tf_config(inventory: Inventory, host_name: str, group: str | None = None) -> str:
    """TF_CONFIG for one host of a group (the host's only group other than "all" when not given)."""
    host = inventory.host(host_name)
    if group is None:
        member_of = [
            name
            for name, members in inventory.groups.items()
            if host.name in members and name not in {"all", "ungrouped"}
        ]
        if len(member_of) != 1:
            raise BadInput(f"host {host.name} is in groups {member_of or 'none'}; choose one with --group")
        group = member_of[0]
    return render_tf_config(inventory.groups, inventory.hostvars(), host.name, group)
