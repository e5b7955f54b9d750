"""Why a run ended without a record of its own: a run directory whose state.json says ``running`` while the
process that wrote it no longer exists.

state.json records the process's identity when a run starts (``rundir.process_identity``: PID, start time,
PID namespace, boot id, memory cgroup and its OOM kill counter, the host's OOM kill counter). Later, from
the same host (``bigmem-train validate``), over SSH (``bigmem-train remote status``) or on the Ansible
controller (the train role), the evidence is weighed here in one place, and the verdict reads
"killed by the out-of-memory killer at about X GiB (planned Y GiB)" instead of a bare exit 137:

* Docker's ``OOMKilled`` flag of the run's container;
* the run's cgroup's OOM kill counter (v2 ``memory.events``, v1 ``memory.oom_control``) above its value
  at the start;
* the host's OOM kill counter (``/proc/vmstat``) above its value at the start, with exit 137 or no
  other explanation (weaker: another process on the host may have been the one killed);
* for a run started by Slurm (state.json's ``slurm`` job id), Slurm's own word: ``sacct`` where the cluster
  keeps accounting, else ``scontrol show job`` while the controller still lists the job. JobState
  ``OUT_OF_MEMORY`` is the cgroup's kill for exceeding ``--mem``; jobacct_gather's ``OverMemoryKill`` (a
  cluster that enforces --mem without cgroups) leaves the job ``FAILED`` with ExitCode ``0:9`` (Slurm
  22.05) and its own line in the job's output file, ``slurmstepd: error: StepId=12.batch exceeded memory
  limit (RSS > LIMIT), being killed``, which is read from there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigmem_train.host import host_oom_kills, oom_kill_count
from bigmem_train.sizes import GIB
from bigmem_train.verdict.rundir import read_memory_csv

EXIT_SIGKILL = 137
# Slurm's job states (squeue(1), JOB STATE CODES) after which the job holds no resources any more.
SLURM_ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
# Slurm's JobState for a job it killed for exceeding its --mem (squeue(1), JOB STATE CODES).
SLURM_OUT_OF_MEMORY = "OUT_OF_MEMORY"
# slurmstepd's line when jobacct_gather's OverMemoryKill kills a step (its RSS and --mem in bytes; before
# Slurm 21.08 "Job 41176 exceeded memory limit (3940736 > 2068480)", in KiB).
_OVER_MEMORY_KILL = re.compile(r"(\S+) exceeded memory limit \((\d+) > (\d+)\), being killed")
_LOG_TAIL_BYTES = 64 * 1024
_SLURM_TIMEOUT_S = 15


@dataclass
class Ending:
    """How a run that left state.json ``running`` ended."""

    # "oom", "killed" (a signal, not the OOM killer by the counters), "rebooted", "unknown"
    cause: str
    message: str
    evidence: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"cause": self.cause, "message": self.message, "evidence": self.evidence}


@dataclass(frozen=True)
class SlurmEnding:
    """How Slurm says a job ended: its JobState, its ExitCode (``code:signal``), its --mem as Slurm shows it
    (``480M``; scontrol only), the command that said it ("" when none did), and slurmstepd's OverMemoryKill
    line from the job's output file when it has one."""

    job_id: str
    state: str
    exit_code: str
    source: str
    mem: str | None = None
    memory_kill: str | None = None

    @property
    def killed_for_memory(self) -> bool:
        return self.state == SLURM_OUT_OF_MEMORY or bool(self.memory_kill)

    def describe(self) -> str:
        said = [f"{self.source} says job {self.job_id} {self.state}, ExitCode {self.exit_code or '?'}"]
        if self.memory_kill:
            said.append(f"the job's output file says {self.memory_kill!r}")
        return "; ".join(said[0 if self.source else 1 :])

    def rss_at_kill(self) -> int | None:
        """The RSS slurmstepd measured when it killed the job for memory (bytes), if its line says."""
        match = _OVER_MEMORY_KILL.search(self.memory_kill or "")
        return int(match.group(2)) if match and match.group(1).startswith("StepId=") else None

    def exit_status(self) -> int | None:
        """The ExitCode as a shell would say it: 128 + the signal when one ended the job, else the code."""
        code, _, signal = self.exit_code.partition(":")
        if signal.isdigit() and int(signal):
            return 128 + int(signal)
        return int(code) if code.isdigit() else None


def _slurm_client(command: list[str]) -> str | None:
    """A Slurm client's output; None when it is missing, hangs or fails (no accounting, no controller)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_SLURM_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def over_memory_kill_line(log: Path) -> str | None:
    """slurmstepd's OverMemoryKill line in a job's output file (its last 64 KiB), or None."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            tail = handle.read().decode(errors="replace")
    except OSError:
        return None
    match = _OVER_MEMORY_KILL.search(tail)
    return match.group(0) if match else None


def slurm_ending(job_id: str, log: Path | None = None) -> SlurmEnding | None:
    """Slurm's state of job ``job_id``: ``sacct`` when the cluster's accounting knows the job, else ``scontrol
    show job`` while the controller lists it (MinJobAge); with slurmstepd's OverMemoryKill line from the job's
    output file (scontrol's StdOut, else ``log``, submit's). None when neither client answers and the file says
    nothing of memory."""
    text = _slurm_client(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"]) or ""
    line = next((line for line in text.splitlines() if line.strip()), "")
    state, _, exit_code = line.partition("|")
    fields: dict[str, str] = {}
    logs = [log] if log else []
    if state.strip():
        # "CANCELLED by 0": the state is the first word.
        fields = {"JobState": state.split()[0], "ExitCode": exit_code.strip()}
        source = "sacct"
    else:
        for part in (_slurm_client(["scontrol", "show", "job", "-o", job_id]) or "").split():
            key, _, value = part.partition("=")
            fields.setdefault(key, value)
        source = "scontrol" if fields.get("JobState") else ""
        if fields.get("StdOut"):
            # One line of fields split at spaces: a path with a space is cut short, and the next is tried.
            logs.insert(0, Path(fields["StdOut"].replace("%j", job_id)))
    memory_kill = next((line for path in logs if (line := over_memory_kill_line(path))), None)
    if not source and not memory_kill:
        return None
    return SlurmEnding(
        job_id,
        fields.get("JobState", ""),
        fields.get("ExitCode", ""),
        source,
        fields.get("MinMemoryNode") or None,
        memory_kill,
    )


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def last_measured_bytes(run_dir: Path, state: dict[str, Any]) -> int | None:
    """The run's last memory sample in its judged measure (the cgroup working set when its cgroup had a
    limit, else RSS)."""
    rows = read_memory_csv(Path(run_dir) / "memory.csv")
    if not rows:
        return None
    limited = bool((state.get("cgroup") or {}).get("limit_bytes"))
    key = "working_set_bytes" if limited and "working_set_bytes" in rows[-1] else "rss_bytes"
    value = rows[-1].get(key)
    return int(value) if value else None


def planned_peak_bytes(run_dir: Path) -> int | None:
    try:
        return json.loads((Path(run_dir) / "plan.json").read_text()).get("peak_bytes")
    except (OSError, ValueError, AttributeError):
        return None


def explain(
    state: dict[str, Any],
    *,
    measured_bytes: int | None,
    planned_bytes: int | None,
    container_oom_killed: bool | None = None,
    cgroup_oom_kills: int | None = None,
    host_oom_kills_now: int | None = None,
    exit_code: int | None = None,
    rebooted: bool = False,
    slurm: SlurmEnding | None = None,
) -> Ending:
    """Weigh the evidence about a run whose process is gone (see the module) into one message."""
    if exit_code is None and slurm is not None:
        exit_code = slurm.exit_status()
    where = f"at about {_gib(measured_bytes)}" if measured_bytes else "at an unknown size (no memory sample)"
    planned = f"planned {_gib(planned_bytes)}" if planned_bytes else "no plan recorded"
    cgroup = state.get("cgroup") or {}
    limit = cgroup.get("limit_bytes")
    limit_text = f"; cgroup v{cgroup.get('version')} limit {_gib(limit)}" if limit else ""
    evidence = []
    if container_oom_killed:
        evidence.append("the container's OOMKilled flag is set")
    start_count = cgroup.get("oom_kills")
    if cgroup_oom_kills is not None and start_count is not None and cgroup_oom_kills > start_count:
        counter = "memory.events" if cgroup.get("version") == 2 else "memory.oom_control"
        evidence.append(
            f"cgroup v{cgroup.get('version')} {counter} oom_kill went from {start_count} to "
            f"{cgroup_oom_kills} during the run"
        )
    host_start = state.get("host_oom_kills")
    host_rose = host_oom_kills_now is not None and host_start is not None and host_oom_kills_now > host_start
    if not evidence and host_rose and exit_code in (None, EXIT_SIGKILL):
        evidence.append(
            f"the host's OOM kill count (/proc/vmstat oom_kill) went from {host_start} to "
            f"{host_oom_kills_now} during the run" + (" and it ended with exit 137" if exit_code else "")
        )
    if slurm is not None and slurm.killed_for_memory:
        recorded = (state.get("slurm") or {}).get("mem_mib")
        mem = f"{recorded}M" if recorded else slurm.mem
        request = f", --mem {mem}" if mem else ""
        job = f"job {slurm.job_id} {slurm.state}".rstrip()
        return Ending(
            "oom",
            f"killed by Slurm for memory {where} ({job}{request}; {planned}{limit_text})",
            "; ".join([slurm.describe(), *evidence]),
        )
    # Slurm's word on any other ending goes with the evidence, after the counters'.
    said = [slurm.describe()] if slurm is not None else []
    if evidence:
        return Ending(
            "oom",
            f"killed by the out-of-memory killer {where} ({planned}{limit_text})",
            "; ".join(evidence + said),
        )
    if rebooted:
        return Ending(
            "rebooted",
            f"the host restarted while the run was running (last sample {where}, {planned})",
            "; ".join(said),
        )
    if exit_code == EXIT_SIGKILL or (exit_code is not None and exit_code > 128):
        return Ending(
            "killed",
            f"killed by signal {exit_code - 128} {where} ({planned}); not by the out-of-memory "
            "killer as far as the OOM counters say",
            "; ".join(said),
        )
    return Ending(
        "unknown",
        f"the process ended without a record {where} ({planned}); no OOM kill was counted",
        "; ".join(said),
    )


def _process_alive(state: dict[str, Any]) -> bool | None:
    """True/False when this host can tell whether the recorded process still runs; None when it cannot."""
    pid = state.get("pid")
    here_ns = os.readlink("/proc/self/ns/pid") if os.path.exists("/proc/self/ns/pid") else None
    if not pid or state.get("pid_namespace") != here_ns:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    start = int(fields[19]) if len(fields) > 19 else None
    return state.get("start_ticks") in (None, start)


def container_id(state: dict[str, Any]) -> str | None:
    """The Docker container a run ran in: recorded from its mounts, else from its cgroup path (``/docker/<id>``,
    ``docker-<id>.scope``; a private cgroup namespace shows only ``/``)."""
    if state.get("container_id"):
        return state["container_id"]
    match = re.search(r"(?:docker[-/])([0-9a-f]{64})", (state.get("cgroup") or {}).get("path") or "")
    return match.group(1) if match else None


def inspect_container(identifier: str) -> dict[str, Any] | None:
    """``docker inspect``'s State of a container, or None (no docker CLI, no such container)."""
    if shutil.which("docker") is None:
        return None
    try:
        result = subprocess.run(
            ["docker", "inspect", "--format", "{{json .State}}", identifier],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    try:
        return json.loads(result.stdout)
    except ValueError:
        return None


def _cgroup_oom_kills_here(state: dict[str, Any]) -> int | None:
    """The run's cgroup OOM kill counter, read where this process can see it (the recorded file when in the
    same namespace, else the host's view of the cgroup path)."""
    cgroup = state.get("cgroup") or {}
    candidates = [cgroup.get("oom_counter_file")]
    if cgroup.get("path"):
        name = "memory.events" if cgroup.get("version") == 2 else "memory.oom_control"
        base = Path("/sys/fs/cgroup") if cgroup.get("version") == 2 else Path("/sys/fs/cgroup/memory")
        candidates.append(str(base / cgroup["path"].lstrip("/") / name))
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            try:
                return oom_kill_count(Path(candidate).read_text())
            except OSError:
                continue
    return None


def _cgroup_peak_here(state: dict[str, Any]) -> int | None:
    folder = (state.get("cgroup") or {}).get("folder")
    version = (state.get("cgroup") or {}).get("version")
    if not folder:
        return None
    try:
        text = (Path(folder) / ("memory.peak" if version == 2 else "memory.max_usage_in_bytes")).read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else None


def diagnose(run_dir: Path, state: dict[str, Any]) -> Ending | None:
    """How the run ended when state.json says ``running`` and its process is gone; None while it runs,
    when it ended with a record, or when this host cannot tell (another PID namespace and no container)."""
    if state.get("state") != "running":
        return None
    return _ending_of_gone_process(run_dir, state)


def after_memory_stop(run_dir: Path, state: dict[str, Any]) -> Ending | None:
    """How a run the memory guard stopped ended, when its process is gone without having written the rest
    (state.json ``leaving``): memory that kept growing past the stop can get it killed by the OOM killer on
    its way out, checkpoint saved. None when it left cleanly, still runs, or this host cannot tell."""
    if state.get("stopped") != "memory" or not state.get("leaving"):
        return None
    return _ending_of_gone_process(run_dir, state)


def _ending_of_gone_process(run_dir: Path, state: dict[str, Any]) -> Ending | None:
    boot_id = (
        Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        if Path("/proc/sys/kernel/random/boot_id").exists()
        else None
    )
    rebooted = bool(state.get("boot_id") and boot_id and state["boot_id"] != boot_id)
    container_state = None
    slurm_job = (state.get("slurm") or {}).get("job_id")
    # `bigmem-train submit` writes the job's output beside its run directory (RESULTS/NAME.slurm-JOBID.out).
    slurm_log = Path(run_dir).parent / f"{Path(run_dir).name}.slurm-{slurm_job}.out"
    slurm, asked_slurm = None, False
    if not rebooted:
        alive = _process_alive(state)
        if alive is None and slurm_job:
            # Another host (a login node): the job's state in Slurm says whether the run still runs.
            slurm, asked_slurm = slurm_ending(slurm_job, slurm_log), True
            alive = None if slurm is None or not slurm.source else slurm.state not in SLURM_ENDED
        if alive is None:
            identifier = container_id(state)
            container_state = inspect_container(identifier) if identifier else None
            if container_state is None:
                return None
            alive = bool(container_state.get("Running"))
        if alive:
            return None
    if slurm_job and not asked_slurm:
        slurm = slurm_ending(slurm_job, slurm_log)
    exit_code = container_state.get("ExitCode") if container_state else None
    measured = last_measured_bytes(run_dir, state)
    if measured is None and slurm is not None:
        # Killed by OverMemoryKill before its first sample: the RSS slurmstepd measured.
        measured = slurm.rss_at_kill()
    if measured is None and not rebooted:
        # Killed before its first sample: the cgroup's own high-water mark, where it can still be read.
        measured = _cgroup_peak_here(state)
    return explain(
        state,
        measured_bytes=measured,
        planned_bytes=planned_peak_bytes(run_dir),
        container_oom_killed=container_state.get("OOMKilled") if container_state else None,
        cgroup_oom_kills=None if rebooted else _cgroup_oom_kills_here(state),
        host_oom_kills_now=None if rebooted else host_oom_kills(),
        exit_code=exit_code,
        rebooted=rebooted,
        slurm=slurm,
    )


def describe_fetched(run_dir: Path, container_oom_killed: bool | None, exit_code: int | None) -> str:
    """One line on how a run directory copied elsewhere (the Ansible controller) ended, from its files and
    what the container runtime said (OOMKilled, exit code)."""
    try:
        state = json.loads((Path(run_dir) / "state.json").read_text())
    except (OSError, ValueError):
        return f"no state.json in {run_dir}"
    if state.get("state") != "running":
        detail = state.get("message") or state.get("error") or ""
        return f"state.json says {state.get('state')}" + (f": {detail}" if detail else "")
    ending = explain(
        state,
        measured_bytes=last_measured_bytes(run_dir, state),
        planned_bytes=planned_peak_bytes(run_dir),
        container_oom_killed=container_oom_killed,
        exit_code=exit_code,
    )
    return ending.message + (f" ({ending.evidence})" if ending.evidence else "")
