"""Fabric tasks: start, watch, stop and fetch jobs on lab servers over SSH, hosts from inventory.ini.

The inventory is read with Ansible's own parser, so ``ansible_host``, ``ansible_user``,
``ansible_port`` and ``ansible_ssh_private_key_file`` mean exactly what they mean to
``ansible-playbook``. Everything on the server is plain files under one folder per job, read by
``sh``, ``awk`` and ``tail``: the server needs no Python of its own for a containerised job.

Layout on a host (``REMOTE_DIR`` is the host's ``bigmem_train_remote_dir``, default
``bigmem-train`` in the login's home)::

    REMOTE_DIR/jobs/NAME/
      config.yaml     the job's config, as given
      job.json        how it was started: mode (docker | process), image or pid, run directory
      job.log         output of a process-mode job (a container's output is in `docker logs`)
      exit_code       written when a process-mode job ends
      results/RUN/    the run directory (state.json, progress.json, history.csv, steps.csv, memory.csv, ...)

Exit codes: 2 bad input (unknown host, no such job, bad config or name); 4 the host cannot be
reached or refuses the login (as ``ansible-playbook`` uses 4 for unreachable hosts).
"""

from __future__ import annotations

import io
import json
import re
import shlex
import socket
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import PRESETS_DIR, load_config
from .distribute import parse_tf_config, per_worker_batch_size, render_tf_config, worker_run_name
from .errors import BadInput, BigmemError
from .sizes import format_bytes

EXIT_UNREACHABLE = 4

DEFAULT_REMOTE_DIR = "bigmem-train"
DEFAULT_EXECUTABLE = "bigmem-train"
DEFAULT_IMAGE = "bigmem-train"
DEFAULT_CONNECT_TIMEOUT = 10.0
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

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


class Unreachable(BigmemError):
    """The host cannot be reached, or it refuses the login (exit 4)."""

    exit_code = EXIT_UNREACHABLE


# --------------------------------------------------------------------------------------------------
# Inventory


@dataclass(frozen=True)
class RemoteHost:
    """One inventory host, with the connection settings Ansible would use for it."""

    name: str
    address: str
    port: int
    user: str | None
    key_file: str | None
    connection: str
    variables: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def remote_dir(self) -> str:
        folder = str(self.variables.get("bigmem_train_remote_dir") or DEFAULT_REMOTE_DIR)
        # ssh and sftp both start in the login's home; "~/x" is spelled "x" so quoting stays simple.
        return folder[2:] if folder.startswith("~/") else folder

    @property
    def executable(self) -> str:
        return str(self.variables.get("bigmem_train_executable") or DEFAULT_EXECUTABLE)

    @property
    def label(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{self.name} ({user}{self.address}:{self.port})"


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, RemoteHost]
    groups: dict[str, list[str]]

    def host(self, name: str) -> RemoteHost:
        if name not in self.hosts:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise BadInput(f"host {name!r} is not in inventory {self.path} (hosts: {known})")
        return self.hosts[name]

    def targets(self, name: str) -> list[RemoteHost]:
        """A host, or every host of a group, in inventory order."""
        if name in self.hosts:
            return [self.hosts[name]]
        if name in self.groups and self.groups[name]:
            return [self.hosts[host] for host in self.groups[name]]
        known = ", ".join(sorted(self.hosts)) or "none"
        groups = (
            ", ".join(sorted(group for group in self.groups if group not in {"all", "ungrouped"})) or "none"
        )
        raise BadInput(
            f"{name!r} is neither a host nor a group of inventory {self.path} "
            f"(hosts: {known}; groups: {groups})"
        )

    def hostvars(self) -> dict[str, dict[str, Any]]:
        return {name: host.variables for name, host in self.hosts.items()}


def _plain(value: Any) -> Any:
    """Ansible's tagged strings and lazy containers as plain Python values."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value)


def load_inventory(path: str | Path) -> Inventory:
    """Parse an Ansible inventory (INI or YAML, with its group_vars/ and host_vars/) with Ansible itself."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise BadInput(f"inventory {path} does not exist (give one with --inventory)")
    try:  # Ansible comes with the optional "ops" extra.
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager
    except ImportError:
        raise BadInput(
            "remote commands need Ansible's inventory parser: pip install 'bigmem-train[ops]'"
        ) from None
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(path)])
    variables = VariableManager(loader=loader, inventory=inventory)
    hosts: dict[str, RemoteHost] = {}
    for host in inventory.get_hosts():
        merged = variables.get_vars(host=host, include_hostvars=False)
        wanted = {
            key: _plain(value)
            for key, value in merged.items()
            if key.startswith(("ansible_", "bigmem_")) and key not in {"ansible_facts", "ansible_play_hosts"}
        }
        hosts[host.name] = _remote_host(host.name, wanted, path)
    if not hosts:
        reason = _why_unparsed(path, loader)
        raise BadInput(
            f"inventory {path} has no hosts: {reason}"
            if reason
            else f"inventory {path} has no hosts (is it an Ansible INI or YAML inventory?)"
        )
    groups = {name: [host.name for host in group.get_hosts()] for name, group in inventory.groups.items()}
    return Inventory(path=path, hosts=hosts, groups=groups)


def _why_unparsed(path: Path, loader: Any) -> str:
    """Ansible's own reason an inventory file gave no hosts, from its INI or YAML plugin ('' if it parses:
    then it just has none). The inventory manager only warns, and not with the reason."""
    from ansible.inventory.data import InventoryData
    from ansible.plugins.loader import inventory_loader

    plugin = inventory_loader.get("yaml" if path.suffix in (".yml", ".yaml") else "ini")
    try:
        plugin.parse(InventoryData(), loader, str(path.resolve()))
    except Exception as error:  # Ansible's parser errors, and what its INI parser lets through
        reason = str(error).removeprefix("Failed to parse inventory: ").splitlines()[0]
        if "unpack" in reason:  # a section header missing its bracket, read as a host line
            reason = "a line Ansible cannot read (an unclosed [section]?)"
        return reason
    return ""


def _remote_host(name: str, variables: dict[str, Any], inventory_path: Path) -> RemoteHost:
    address = variables.get("ansible_host") or variables.get("ansible_ssh_host") or name
    port_value = variables.get("ansible_port") or variables.get("ansible_ssh_port") or 22
    try:
        port = int(port_value)
    except (TypeError, ValueError):
        raise BadInput(
            f"inventory {inventory_path}: host {name} has ansible_port {port_value!r}, not a number"
        ) from None
    user = variables.get("ansible_user") or variables.get("ansible_ssh_user")
    key_file = variables.get("ansible_ssh_private_key_file") or variables.get("ansible_private_key_file")
    if key_file:
        key_path = Path(str(key_file)).expanduser()
        if not key_path.is_absolute():
            # Ansible resolves a relative key path against the directory it is run from; the inventory's
            # folder is the stable choice for a file that travels with it.
            key_path = inventory_path.parent / key_path
        key_file = str(key_path)
    return RemoteHost(
        name=name,
        address=str(address),
        port=port,
        user=str(user) if user else None,
        key_file=key_file,
        connection=str(variables.get("ansible_connection") or "ssh"),
        variables=variables,
    )


# --------------------------------------------------------------------------------------------------
# Connections


@contextmanager
def connect(host: RemoteHost, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Iterator[Any]:
    """An open Fabric connection to ``host``; Unreachable (exit 4) with one line when there is none."""
    # Fabric and Paramiko come with the optional "ops" extra; a host that only trains does without them.
    import fabric
    import paramiko

    if host.connection not in {"ssh", "paramiko", "smart"}:
        raise BadInput(
            f"host {host.name} uses ansible_connection={host.connection}; remote commands need SSH "
            f"(on that machine run `bigmem-train run` directly)"
        )
    connect_kwargs: dict[str, Any] = {}
    if host.key_file:
        if not Path(host.key_file).is_file():
            raise BadInput(f"host {host.name}: ansible_ssh_private_key_file {host.key_file} does not exist")
        # Only the inventory's key: a key from the agent or ~/.ssh must not make a wrong setting work.
        connect_kwargs = {"key_filename": [host.key_file], "look_for_keys": False, "allow_agent": False}
    connection = fabric.Connection(
        host.address, user=host.user, port=host.port, connect_timeout=timeout, connect_kwargs=connect_kwargs
    )
    try:
        connection.open()
    except paramiko.AuthenticationException:
        key = f"key {host.key_file}" if host.key_file else "the default keys"
        raise Unreachable(
            f"{host.label}: login refused ({key} not accepted for user {connection.user})"
        ) from None
    except paramiko.BadHostKeyException:
        raise Unreachable(
            f"{host.label}: host key does not match known_hosts (the server was "
            f"reinstalled, or this is not that server)"
        ) from None
    except TimeoutError:
        raise Unreachable(f"{host.label}: unreachable (no answer within {timeout:g} s)") from None
    except paramiko.ssh_exception.NoValidConnectionsError as error:
        reason = (
            "connection refused"
            if all(
                isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == 111
                for e in error.errors.values()
            )
            else str(error)
        )
        raise Unreachable(f"{host.label}: unreachable ({reason})") from None
    except socket.gaierror as error:
        raise Unreachable(
            f"{host.label}: unreachable (cannot resolve {host.address}: {error.strerror})"
        ) from None
    except (OSError, paramiko.SSHException) as error:
        raise Unreachable(f"{host.label}: unreachable ({type(error).__name__}: {error})") from None
    try:
        yield connection
    finally:
        connection.close()


def _run(connection: Any, command: str, stream: bool = False) -> Any:
    """Run a shell command; never raises on a non-zero exit (callers look at ``.exited``)."""
    return connection.run(command, hide=not stream, warn=True, in_stream=False, pty=False)


def _put_text(connection: Any, text: str, remote_path: str) -> None:
    connection.put(io.BytesIO(text.encode()), remote=remote_path)


# --------------------------------------------------------------------------------------------------
# Jobs


def job_dir(host: RemoteHost, name: str) -> str:
    return f"{host.remote_dir}/jobs/{name}"


def check_job_name(name: str) -> str:
    if not JOB_NAME.match(name):
        raise BadInput(f"job name {name!r}: use letters, digits, '.', '_' and '-' (a container name)")
    return name


def default_job_name() -> str:
    return time.strftime("bigmem-%Y%m%d-%H%M%S")


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
    existing = _read_job(connection, host, name, required=False)
    if existing is not None and _is_running(connection, existing):
        raise BadInput(
            f"job {name} is already running on {host.name}; stop it first or choose another --name"
        )
    if request.docker:
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
    made = _run(
        connection, f"mkdir -p {shlex.quote(folder)}/results && rm -f {shlex.quote(folder)}/exit_code"
    )
    if made.exited != 0:
        raise BadInput(f"cannot create {folder} on {host.name}: {made.stderr.strip()}")
    _put_text(connection, config_text, f"{folder}/config.yaml")
    job: dict[str, Any] = {
        "name": name,
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
        result = _run(
            connection,
            f"cd {shlex.quote(folder)} && (docker rm -f {shlex.quote(name)} >/dev/null 2>&1; {command})",
        )
        if result.exited != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("docker:")] or [
                result.stderr
            ]
            raise BadInput(f"docker run failed on {host.name}: {errors[0].strip()}")
        job["container_id"] = result.stdout.strip()[:12]
    else:
        command = process_command(host.executable, name, request.data_dir, environment)
        # Not `cd && job &`: that would background the list, whose shell holds the SSH channel open.
        result = _run(connection, f"cd {shlex.quote(folder)} || exit 1\n{command}")
        pid = result.stdout.strip()
        if result.exited != 0 or not pid.isdigit():
            raise BadInput(f"could not start {host.executable} on {host.name}: {result.stderr.strip()}")
        job["pid"] = int(pid)
    _put_text(connection, json.dumps(job, indent=2) + "\n", f"{folder}/job.json")
    return job


def docker_run_command(
    name: str,
    image: str,
    folder: str,
    run_name: str,
    data_dir: str | None,
    environment: dict[str, str],
    numa_nodes: int = 1,
) -> str:
    """`docker run -d` of one job: hardened, results and config mounted from the job's folder."""
    quote = shlex.quote
    parts = [
        "docker",
        "run",
        "-d",
        "--name",
        quote(name),
        "--user",
        '"$(id -u):$(id -g)"',
        *HARDENED_DOCKER_FLAGS,
        "-v",
        '"$PWD/results":/results',
        "-v",
        '"$PWD/config.yaml":/config/job.yaml:ro',
    ]
    if data_dir:
        parts += ["-v", f"{quote(data_dir)}:/data:ro"]
    # The workers of a multi-worker job reach each other on the ports TF_CONFIG names.
    parts += ["--network", "host" if environment.get("TF_CONFIG") else "none"]
    if numa_nodes > 1:
        # numactl binds memory and cores to NUMA nodes (the planner's placement).
        parts += ["--cap-add", "SYS_NICE"]
    for key, value in environment.items():
        parts += ["-e", quote(f"{key}={value}")]
    parts += [
        quote(image),
        "run",
        "--config",
        "/config/job.yaml",
        "--results",
        "/results",
        "--run-name",
        quote(run_name),
    ]
    if data_dir:
        parts += ["--data", "/data"]
    return " ".join(parts)


def process_command(executable: str, run_name: str, data_dir: str | None, environment: dict[str, str]) -> str:
    """Start bigmem-train detached in its own session (so `stop` can end the whole process group).

    The shell that waits for it writes the exit code; its pid, printed, is the session's id.
    """
    quote = shlex.quote
    job = [executable, "run", "--config", "config.yaml", "--results", "results", "--run-name", run_name]
    if data_dir:
        job += ["--data", data_dir]
    inner = f"{' '.join(quote(part) for part in job)}; echo $? > exit_code"
    exports = "".join(f"{key}={quote(value)} " for key, value in environment.items())
    return f"{exports}setsid nohup sh -c {quote(inner)} > job.log 2>&1 < /dev/null & echo $!"


def _read_job(connection: Any, host: RemoteHost, name: str, required: bool = True) -> dict[str, Any] | None:
    check_job_name(name)
    result = _run(connection, f"cat {shlex.quote(job_dir(host, name))}/job.json")
    if result.exited != 0:
        if required:
            raise BadInput(f"no job named {name} on {host.name} (looked for {job_dir(host, name)})")
        return None
    try:
        job = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise BadInput(f"{job_dir(host, name)}/job.json on {host.name} is not valid JSON") from None
    job["folder"] = job_dir(host, name)
    return job


def _is_running(connection: Any, job: dict[str, Any]) -> bool:
    if job.get("mode") == "docker":
        result = _run(
            connection, f"docker inspect -f '{{{{.State.Running}}}}' {shlex.quote(job['container'])}"
        )
        return result.stdout.strip() == "true"
    folder = shlex.quote(job["folder"])
    result = _run(connection, f"kill -0 {int(job['pid'])} 2>/dev/null && [ ! -e {folder}/exit_code ]")
    return result.exited == 0


# One round trip reads everything status shows; sections are split on "@@name" lines.
_STATUS_SCRIPT = r"""
cd {folder} || exit 3
run={run_dir}
section() {{ echo "@@$1"; }}
section exit_code; cat exit_code 2>/dev/null
section state; cat "$run/state.json" 2>/dev/null
section progress; cat "$run/progress.json" 2>/dev/null
section history; head -n 1 "$run/history.csv" 2>/dev/null; tail -n 1 "$run/history.csv" 2>/dev/null
section steps; tail -n 1 "$run/steps.csv" 2>/dev/null
section memory
[ -s "$run/memory.csv" ] && awk -F, 'NR == 1 {{ for (i = 1; i <= NF; i++) if ($i == "rss_bytes") c = i; next }}
  c && $c + 0 > peak {{ peak = $c + 0 }} c {{ live = $c }} END {{ if (c) printf "%.0f %.0f\n", live, peak }}' "$run/memory.csv"
section config_epochs; awk '/^training:/ {{ t = 1; next }} /^[^ ]/ {{ t = 0 }} t && $1 == "epochs:" {{ print $2 }}' "$run/config.yaml" 2>/dev/null
section verdict; cat "$run/verdict.json" 2>/dev/null
section metrics; cat "$run/metrics.json" 2>/dev/null
section memory_last; head -n 1 "$run/memory.csv" 2>/dev/null; tail -n 1 "$run/memory.csv" 2>/dev/null
section plan_peak; grep -o '"peak_bytes": [0-9]*' "$run/plan.json" 2>/dev/null | head -n 1 | tr -dc 0-9; echo
section host_oom; awk '$1 == "oom_kill" {{ print $2 }}' /proc/vmstat 2>/dev/null
section cgroup_oom
counter=$(sed -n 's/.*"oom_counter_file": "\([^"]*\)".*/\1/p' "$run/state.json" 2>/dev/null | head -n 1)
[ -n "$counter" ] && [ -z {container} ] && awk '$1 == "oom_kill" {{ print $2 }}' "$counter" 2>/dev/null
section container
[ -n {container} ] && docker inspect -f '{{{{.State.OOMKilled}}}} {{{{.State.ExitCode}}}}' {container} 2>/dev/null
true
"""


def _sections(text: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return {key: value.strip() for key, value in sections.items()}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


def status(
    inventory: Inventory, target: str, name: str, timeout: float = DEFAULT_CONNECT_TIMEOUT
) -> list[dict[str, Any]]:
    """Status of a job on a host (or on every worker of a group), read from the run's own files."""
    reports = []
    for host in inventory.targets(target):
        with connect(host, timeout) as connection:
            reports.append(_status_on(connection, host, name))
    return reports


def _status_on(connection: Any, host: RemoteHost, name: str) -> dict[str, Any]:
    job = _read_job(connection, host, name)
    running = _is_running(connection, job)
    container = job.get("container") if job.get("mode") == "docker" else ""
    script = _STATUS_SCRIPT.format(
        folder=shlex.quote(job["folder"]),
        run_dir=shlex.quote(job["run_dir"]),
        container=shlex.quote(container or ""),
    )
    sections = _sections(_run(connection, script).stdout)
    state_file = _json_or_none(sections.get("state", "")) or {}
    progress = _json_or_none(sections.get("progress", "")) or {}
    exit_code = sections.get("exit_code") or None
    if running:
        state = "running"
    elif job.get("stopped"):
        state = "stopped"
    elif state_file.get("state") in {"finished", "failed"}:
        state = state_file["state"]
    elif job.get("mode") == "process" and exit_code is None:
        state = "gone"  # killed without writing its exit code
    else:
        state = "exited"
    report: dict[str, Any] = {
        "host": host.name,
        "name": name,
        "state": state,
        "mode": job.get("mode"),
        "run_dir": f"{job['folder']}/{job['run_dir']}",
        "started": job.get("started"),
        "run_state": state_file.get("state"),
        "error": state_file.get("error"),
        "exit_code": int(exit_code) if exit_code and exit_code.lstrip("-").isdigit() else None,
    }
    epochs = sections.get("config_epochs")
    report["epochs"] = int(epochs) if epochs and epochs.isdigit() else None
    if progress:
        report["epoch"] = int(progress.get("epoch", 0)) + 1
        report["step"] = progress.get("step")
        report["steps_per_epoch"] = progress.get("steps_per_epoch")
    elif sections.get("steps") and not sections["steps"].startswith("epoch"):
        fields = sections["steps"].split(",")
        report["epoch"], report["step"] = int(fields[0]) + 1, int(fields[1]) + 1
    history = sections.get("history", "").splitlines()
    if len(history) == 2 and history[0] != history[1]:
        last = dict(zip(history[0].split(","), history[1].split(",")))
        report["last_epoch"] = {key: _number(value) for key, value in last.items()}
    memory = sections.get("memory", "").split()
    if len(memory) == 2:
        report["live_rss_bytes"], report["peak_rss_bytes"] = int(memory[0]), int(memory[1])
        if not running:
            report["live_rss_bytes"] = 0
    verdict = _json_or_none(sections.get("verdict", ""))
    if verdict:
        report["verdict"] = verdict.get("verdict")
    metrics = _json_or_none(sections.get("metrics", ""))
    if metrics and metrics.get("peak_rss_bytes"):
        report["peak_rss_bytes"] = max(report.get("peak_rss_bytes", 0), int(metrics["peak_rss_bytes"]))
    if state_file.get("stopped") == "memory":
        report["state"] = "stopped"
        report["error"] = state_file.get("message")
    if not running and state_file.get("state") == "running":
        ending = _ending(state_file, sections, report.get("exit_code"))
        report["state"] = "killed" if ending.cause in {"oom", "killed", "heap_limit"} else report["state"]
        report["ending"] = ending.to_dict()
        report["error"] = ending.message + (f" ({ending.evidence})" if ending.evidence else "")
    return report


def _ending(state_file: dict[str, Any], sections: dict[str, str], exit_code: int | None):
    """How a run whose state.json says running, and whose process is gone, ended (postmortem.explain)."""
    from .postmortem import explain

    def integer(text: str | None) -> int | None:
        return int(text) if text and text.strip().isdigit() else None

    container = sections.get("container", "").split()
    oom_killed = container[0] == "true" if container else None
    if len(container) == 2 and container[1].lstrip("-").isdigit():
        exit_code = int(container[1])
    measured = None
    memory = sections.get("memory_last", "").splitlines()
    if len(memory) == 2 and memory[0] != memory[1]:
        row = dict(zip(memory[0].split(","), memory[1].split(",")))
        limited = bool((state_file.get("cgroup") or {}).get("limit_bytes"))
        column = "working_set_bytes" if limited and row.get("working_set_bytes") else "rss_bytes"
        measured = integer(row.get(column))
    return explain(
        state_file,
        measured_bytes=measured,
        planned_bytes=integer(sections.get("plan_peak")),
        container_oom_killed=oom_killed,
        cgroup_oom_kills=integer(sections.get("cgroup_oom")),
        host_oom_kills_now=integer(sections.get("host_oom")),
        exit_code=exit_code,
    )


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def format_status(report: dict[str, Any]) -> str:
    lines = [
        f"{report['name']} on {report['host']}: {report['state']}"
        + (f" (exit code {report['exit_code']})" if report.get("exit_code") not in (None, 0) else "")
    ]
    if report.get("epoch"):
        epochs = f"/{report['epochs']}" if report.get("epochs") else ""
        steps = f"/{report['steps_per_epoch']}" if report.get("steps_per_epoch") else ""
        lines.append(f"  epoch {report['epoch']}{epochs}, step {report.get('step')}{steps}")
    last = report.get("last_epoch")
    if last:
        shown = ", ".join(
            f"{key} {value:.4f}" for key, value in last.items() if key != "epoch" and isinstance(value, float)
        )
        lines.append(f"  last finished epoch {int(last.get('epoch', 0)) + 1}: {shown}")
    if "peak_rss_bytes" in report:
        live = format_bytes(report["live_rss_bytes"]) if report.get("live_rss_bytes") else "-"
        lines.append(f"  memory: live {live}, peak {format_bytes(report['peak_rss_bytes'])}")
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    if report.get("verdict"):
        lines.append(f"  verdict: {report['verdict']}")
    lines.append(f"  run directory: {report['run_dir']}")
    return "\n".join(lines)


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
