"""The run directory: one folder per job, a state file, and the checks that keep finished runs safe."""

from __future__ import annotations

import csv
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bigmem_train.config import Config
from bigmem_train.errors import BadInput

STATE_FILE = "state.json"
RUNNING, FINISHED, FAILED, STOPPED = "running", "finished", "failed", "stopped"
# Config fields a run stopped for memory (the guard) may change when it is resumed: the
# U-Net's weights and its optimizer state do not depend on them.
RESIZABLE_ON_RESUME = (
    ("training", "batch_size"),
    ("data", "input_shape"),
    ("footprint", "tolerance"),
)
# Config fields any unfinished run may change when it is resumed: how the job is run, not what it computes.
CHANGEABLE_ON_RESUME = (
    # A multi-worker job stopped because a slow host missed its heartbeats resumes with a longer timeout.
    ("training", "worker_heartbeat_timeout"),
)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename), so a reader never sees half a file; a failed write leaves
    the file as it was and no temp file."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(json.dumps(data, indent=2, default=str) + "\n")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{path} is not valid JSON") from None


def read_record(path: Path) -> dict[str, Any]:
    """A run's JSON record, or {} when the run has not written it (yet)."""
    path = Path(path)
    return read_json(path) if path.exists() else {}


def read_state(run_dir: Path) -> dict[str, Any]:
    return read_record(Path(run_dir) / STATE_FILE)


def set_state(run_dir: Path, state: str, **extra: Any) -> None:
    current = read_state(run_dir)
    current.update(extra, state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    current.setdefault("started", current["updated"])
    if state == FINISHED:
        current["finished"] = current["updated"]
    write_json(Path(run_dir) / STATE_FILE, current)


def _read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def process_identity() -> dict[str, Any]:
    """What tells, later and from elsewhere, whether the process writing a run still exists and why it
    ended: PID, its start time (so a reused PID is not taken for it), PID namespace, boot id, hostname,
    its memory cgroup with that cgroup's OOM kill counter, the host's OOM kill counter, now, and the Slurm
    job it runs in."""
    from bigmem_train.host import find_memory_cgroup, host_oom_kills

    stat = _read_text("/proc/self/stat")
    fields = stat.rsplit(")", 1)[-1].split()
    identity: dict[str, Any] = {
        "pid": os.getpid(),
        # Field 22 of /proc/PID/stat (the 20th after the command name): start time in clock ticks since boot.
        "start_ticks": int(fields[19]) if len(fields) > 19 else None,
        "pid_namespace": os.readlink("/proc/self/ns/pid") if os.path.exists("/proc/self/ns/pid") else None,
        "boot_id": _read_text("/proc/sys/kernel/random/boot_id").strip() or None,
        "hostname": os.uname().nodename,
        "host_oom_kills": host_oom_kills(),
    }
    # The Docker container this runs in (its files are mounted from /var/lib/docker/containers/ID/), so a
    # later look from the host can ask Docker how it ended, whatever the cgroup namespace shows.
    container = re.search(r"/containers/([0-9a-f]{64})/", _read_text("/proc/self/mountinfo"))
    if container:
        identity["container_id"] = container.group(1)
    cgroup = find_memory_cgroup()
    if cgroup is not None:
        identity["cgroup"] = cgroup_record(cgroup)
    slurm = slurm_record(os.environ)
    if slurm:
        identity["slurm"] = slurm
    return identity


def slurm_record(environment: Mapping[str, str]) -> dict[str, Any] | None:
    """The Slurm job a run was started in, from the variables slurmd sets (sbatch(1), OUTPUT ENVIRONMENT
    VARIABLES): its id, cluster and --mem in MiB, so that postmortem can ask Slurm how the job ended
    (a job Slurm kills for memory leaves no record of its own). None outside Slurm."""
    job_id = environment.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None
    memory = environment.get("SLURM_MEM_PER_NODE", "").strip()
    return {
        "job_id": job_id,
        "cluster": environment.get("SLURM_CLUSTER_NAME") or None,
        "mem_mib": int(memory) if memory.isdigit() else None,
    }


def cgroup_record(cgroup) -> dict[str, Any]:
    """The memory cgroup as state.json records it: where it is, its OOM-kill counter file and count, its limit
    (postmortem reads the counter again to tell an OOM kill)."""
    return {
        "version": cgroup.version,
        "path": cgroup.path,
        "folder": str(cgroup.folder),
        "oom_counter_file": str(cgroup.oom_counter_file),
        "oom_kills": cgroup.oom_kills(),
        "limit_bytes": cgroup.limit_bytes(),
    }


def _resizable_difference(
    saved_text: str, resolved_text: str, fields: tuple[tuple[str, str], ...]
) -> list[str] | None:
    """The ``fields`` (dotted) two configs differ in, or None when they differ anywhere else."""
    import yaml

    saved, resolved = yaml.safe_load(saved_text), yaml.safe_load(resolved_text)
    changed = []
    for section, key in fields:
        if (saved.get(section) or {}).get(key) != (resolved.get(section) or {}).get(key):
            changed.append(f"{section}.{key}")
            saved.setdefault(section, {})[key] = (resolved.get(section) or {}).get(key)
    return changed if saved == resolved else None


def ensure_writable(folder: Path) -> None:
    """Create ``folder`` if needed and check this user can write there; one clear line otherwise."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise BadInput(
            f"results folder {folder} cannot be created by uid {os.getuid()}: permission denied"
        ) from None
    except OSError as error:
        raise BadInput(f"results folder {folder} cannot be created: {error.strerror}") from None
    if not folder.is_dir():
        raise BadInput(f"results folder {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        owner = folder.stat().st_uid
        raise BadInput(
            f"results folder {folder} is not writable by uid {os.getuid()} (owned by uid {owner}); "
            f"chown it to {os.getuid()} or run with --user {owner}"
        )


def prepare_run_dir(config: Config) -> tuple[Path, bool]:
    """Create or reopen the run directory; returns (path, resuming).

    A named run that exists unfinished is resumed if its config matches; a finished one is never
    overwritten.
    """
    results = Path(config.output.results_dir)
    ensure_writable(results)
    name = config.output.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = results / name
    resolved = config.to_yaml()
    if config.output.run_name is None:
        # Two unnamed runs started in the same second get folders of their own (mkdir decides, so two
        # processes cannot both take one); an unnamed run is never a resume. ensure_writable made ``results``.
        suffix = 1
        while True:
            try:
                run_dir.mkdir()
                break
            except FileExistsError:
                suffix += 1
                run_dir = results / f"{name}-{suffix}"
        resuming = False
    elif run_dir.exists():
        state = read_state(run_dir).get("state")
        if state == FINISHED:
            raise BadInput(f"run {run_dir} already finished; choose another --run-name (it is kept as it is)")
        saved = run_dir / "config.yaml"
        if saved.exists() and saved.read_text() != resolved:
            stopped_for_memory = read_state(run_dir).get("stopped") == "memory"
            fields = (RESIZABLE_ON_RESUME if stopped_for_memory else ()) + CHANGEABLE_ON_RESUME
            changed = _resizable_difference(saved.read_text(), resolved, fields)
            if not changed:
                hint = (
                    " (a run stopped for memory may change only training.batch_size, data.input_shape, "
                    "footprint.tolerance and training.worker_heartbeat_timeout)"
                    if stopped_for_memory
                    else " (a resumed run may change only training.worker_heartbeat_timeout)"
                )
                raise BadInput(
                    f"run {run_dir} exists with a different config; choose another --run-name{hint}"
                )
            print(f"bigmem-train: resuming {run_dir.name} with a new {' and '.join(changed)}", flush=True)
        if not (run_dir / STATE_FILE).exists() and any(run_dir.iterdir()):
            raise BadInput(f"{run_dir} exists and is not a bigmem-train run; choose another --run-name")
        resuming = (run_dir / "backup").exists()
    else:
        run_dir.mkdir(parents=True)
        resuming = False
    (run_dir / "config.yaml").write_text(resolved)
    # A resumed run drops what the last session ended with (the guard's stop, an error) and the Slurm job it
    # ran in (process_identity records this session's, if any).
    state = {
        key: value
        for key, value in read_state(run_dir).items()
        if key not in {"stopped", "error", "guard", "leaving", "slurm"}
    }
    if state:
        write_json(run_dir / STATE_FILE, state)
    set_state(run_dir, RUNNING, **process_identity())
    return run_dir, resuming


# Readers of the files a run writes (history.csv by Keras' CSVLogger, steps.csv by train.StepTimer,
# memory.csv by monitor.MemorySampler), shared by train, validate and report.


def read_history(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            parsed = {}
            for key, value in row.items():
                try:
                    parsed[key] = float(value)
                except (TypeError, ValueError):
                    continue
            rows.append(parsed)
    return rows


def read_step_seconds(path: Path) -> list[float]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [float(row["seconds"]) for row in csv.DictReader(handle)]


def read_memory_csv(path: Path) -> list[dict[str, float]]:
    """Rows of a memory.csv as floats (for validation and the report); empty cells are left out."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as handle:
        rows = []
        for row in csv.DictReader(handle):
            parsed = {}
            for key, value in row.items():
                if key is None or value in (None, ""):
                    continue
                try:
                    parsed[key] = float(value)
                except (TypeError, ValueError):
                    continue
            rows.append(parsed)
        return rows
