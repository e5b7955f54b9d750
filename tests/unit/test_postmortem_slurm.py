"""A run Slurm started and then killed for memory: the run records its Slurm job at start, and ``validate``
asks Slurm how it ended (``sacct`` when accounting answers, else ``scontrol show job``) and names a kill for
memory (JobState OUT_OF_MEMORY). The Slurm clients are stand-ins on PATH that print recorded outputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.verdict.postmortem import diagnose, slurm_ending
from bigmem_train.verdict.rundir import process_identity, slurm_record
from bigmem_train.verdict.validate import evaluate

# Recorded on Debian 12's Slurm 22.05 (tests/fixtures/slurm.py's cluster with OverMemoryKill): a job whose
# RSS passed its --mem=400M, killed by slurmstepd's jobacct_gather. `scontrol show job -o 1`:
SCONTROL_OVER_MEMORY_KILL = (
    "JobId=1 JobName=oom400 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=FAILED Reason=JobLaunchFailure Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=0:9 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-12-06T17:20:05 EligibleTime=2026-12-06T17:20:05 AccrueTime=2026-12-06T17:20:05 "
    "StartTime=2026-12-06T17:20:08 EndTime=2026-12-06T17:20:09 Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-12-06T17:20:08 Scheduler=Main Partition=bigmem AllocNode:Sid=localhost:23915 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 NumTasks=1 "
    "CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=400M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=400M MinTmpDiskNode=0 Features=(null) "
    "DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) "
    "WorkDir=/tmp/skwuddx7sp/work StdErr={log} StdIn=/dev/null StdOut={log} Power=\n"
)
# The end of that job's output file (the kit's lines, then slurmstepd's).
OVER_MEMORY_KILL_LOG = """bigmem-train: run directory /tmp/skwuddx7sp/work/results/oom400
slurmstepd-vm: error: StepId=1.batch exceeded memory limit (462499840 > 419430400), being killed
slurmstepd-vm: error: Exceeded job memory limit
slurmstepd-vm: error: *** JOB 1 ON vm CANCELLED AT 2026-12-06T17:20:45 ***
slurmstepd-vm: error: StepId=1.batch exceeded memory limit (462499840 > 419430400), being killed
slurmstepd-vm: error: Exceeded job memory limit
"""
# `sacct -j 1 -X -n -P -o State,ExitCode` on that cluster (AccountingStorageType=accounting_storage/none):
# exit 1, on stderr.
SACCT_NO_ACCOUNTING = "Slurm accounting storage is disabled\n"
# A job the cgroup killed (ConstrainRAMSpace): `sacct -j 12 -X -n -P -o State,ExitCode`, and scontrol's line
# (the recorded one above with the state, reason and exit code Slurm gives a cgroup OOM kill, and job 12).
SACCT_OUT_OF_MEMORY = "OUT_OF_MEMORY|0:125\n"
SCONTROL_OUT_OF_MEMORY = (
    SCONTROL_OVER_MEMORY_KILL.replace("JobId=1 ", "JobId=12 ")
    .replace("JobState=FAILED Reason=JobLaunchFailure", "JobState=OUT_OF_MEMORY Reason=OutOfMemory")
    .replace("ExitCode=0:9", "ExitCode=0:125")
    .replace("400M", "480M")
    .format(log="/shared/results/oom.slurm-12.out")
)
SCONTROL_UNKNOWN = "slurm_load_jobs error: Invalid job id specified\n"
HISTORY = "epoch,dice,hard_dice,loss,val_dice,val_hard_dice,val_loss\n0,0.2,0.2,1.0,0.3,0.3,1.0\n"


def stand_in(folder: Path, name: str, output: str, exit_code: int = 0) -> None:
    """An executable ``name`` that logs its arguments and prints ``output`` (to stderr when it fails)."""
    script = folder / name
    stream = "" if exit_code == 0 else " >&2"
    script.write_text(
        f'#!/bin/sh\necho "{name} $*" >> "{folder}/calls"\n/bin/cat{stream} <<\'EOF\'\n{output}EOF\n'
        f"exit {exit_code}\n"
    )
    script.chmod(0o755)


@pytest.fixture
def clients(tmp_path, monkeypatch) -> Path:
    """A PATH with only the stand-ins the test writes there (the real Slurm clients may be installed)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


def calls(folder: Path) -> list[str]:
    path = folder / "calls"
    return path.read_text().splitlines() if path.exists() else []


def gone_pid() -> int:
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    return child.pid


def killed_run(tmp_path: Path, slurm: dict | None = None, **identity) -> Path:
    """A run directory left ``running`` by a process that is gone, one memory sample of 0.60 GiB, planned
    0.45 GiB, started as Slurm job 12 with --mem 480M."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(None, {"training.epochs": 3}).to_yaml())
    (run_dir / "history.csv").write_text(HISTORY)
    (run_dir / "plan.json").write_text(json.dumps({"peak_bytes": int(0.45 * 2**30)}))
    (run_dir / "memory.csv").write_text(f"time_unix,elapsed_s,rss_bytes\n1.0,0.5,{int(0.6 * 2**30)}\n")
    state = {
        **process_identity(),
        "state": "running",
        "pid": gone_pid(),
        "host_oom_kills": None,
        "slurm": slurm or {"job_id": "12", "cluster": "lab", "mem_mib": 480},
        **identity,
    }
    state.pop("cgroup", None)
    (run_dir / "state.json").write_text(json.dumps(state))
    return run_dir


def finished_detail(run_dir: Path) -> str:
    return {criterion.name: criterion for criterion in evaluate(run_dir).criteria}["finished"].detail


def test_a_run_records_the_slurm_job_it_was_started_in(monkeypatch):
    variables = {"SLURM_JOB_ID": "12", "SLURM_CLUSTER_NAME": "lab", "SLURM_MEM_PER_NODE": "480"}
    assert slurm_record(variables) == {"job_id": "12", "cluster": "lab", "mem_mib": 480}
    assert slurm_record({"SLURM_JOB_ID": "7"}) == {"job_id": "7", "cluster": None, "mem_mib": None}
    assert slurm_record({}) is None
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert "slurm" not in process_identity()
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert process_identity()["slurm"] == {"job_id": "12", "cluster": "lab", "mem_mib": 480}


def test_validate_names_a_slurm_memory_kill_from_sacct(tmp_path, clients, capsys):
    stand_in(clients, "sacct", SACCT_OUT_OF_MEMORY)
    stand_in(clients, "scontrol", SCONTROL_OUT_OF_MEMORY)
    run_dir = killed_run(tmp_path)
    assert finished_detail(run_dir) == (
        "killed by Slurm for memory at about 0.60 GiB (job 12 OUT_OF_MEMORY, --mem 480M; planned 0.45 GiB) "
        "(sacct says job 12 OUT_OF_MEMORY, ExitCode 0:125); 1 of 3 epochs finished"
    )
    assert calls(clients) == ["sacct -j 12 -X -n -P -o State,ExitCode"]  # accounting answered: no scontrol
    assert main(["validate", str(run_dir)]) == 1
    assert "[FAIL] finished: killed by Slurm for memory" in capsys.readouterr().out


def test_without_accounting_validate_asks_scontrol_for_the_cgroups_kill(tmp_path, clients):
    stand_in(clients, "sacct", SACCT_NO_ACCOUNTING, exit_code=1)
    stand_in(clients, "scontrol", SCONTROL_OUT_OF_MEMORY)
    # No --mem recorded (a run started before the kit recorded it): scontrol's MinMemoryNode.
    run_dir = killed_run(tmp_path, slurm={"job_id": "12"})
    ending = diagnose(run_dir, json.loads((run_dir / "state.json").read_text()))
    assert ending is not None and ending.cause == "oom"
    assert ending.message == (
        "killed by Slurm for memory at about 0.60 GiB (job 12 OUT_OF_MEMORY, --mem 480M; planned 0.45 GiB)"
    )
    assert ending.evidence == "scontrol says job 12 OUT_OF_MEMORY, ExitCode 0:125"
    assert calls(clients) == ["sacct -j 12 -X -n -P -o State,ExitCode", "scontrol show job -o 12"]


def test_another_slurm_ending_is_said_and_not_taken_for_memory(tmp_path, clients):
    stand_in(clients, "sacct", "CANCELLED by 0|0:15\n")
    ending = slurm_ending("12")
    assert (ending.state, ending.exit_code, ending.exit_status()) == ("CANCELLED", "0:15", 143)
    assert finished_detail(killed_run(tmp_path)) == (
        "killed by signal 15 at about 0.60 GiB (planned 0.45 GiB); not by the out-of-memory killer as far as "
        "the OOM counters say (sacct says job 12 CANCELLED, ExitCode 0:15); 1 of 3 epochs finished"
    )


def test_no_slurm_client_and_a_forgotten_job_leave_the_verdict_as_without_slurm(tmp_path, clients):
    run_dir = killed_run(tmp_path)
    # Neither sacct nor scontrol on PATH: no error, the ending the counters tell.
    without = (
        "the process ended without a record at about 0.60 GiB (planned 0.45 GiB); no OOM kill was counted; "
        "1 of 3 epochs finished"
    )
    assert slurm_ending("12") is None
    assert finished_detail(run_dir) == without
    # Both present, neither knows the job (no accounting; the controller forgot it after MinJobAge).
    stand_in(clients, "sacct", SACCT_NO_ACCOUNTING, exit_code=1)
    stand_in(clients, "scontrol", SCONTROL_UNKNOWN, exit_code=1)
    assert finished_detail(run_dir) == without
    assert len(calls(clients)) == 2


def test_from_another_host_slurm_says_whether_the_run_still_runs(tmp_path, clients):
    """validate on a login node: the run's PID namespace is not this one; the job's state decides."""
    run_dir = killed_run(tmp_path, pid_namespace="pid:[1]")
    state = json.loads((run_dir / "state.json").read_text())
    stand_in(clients, "sacct", "RUNNING|0:0\n")
    assert diagnose(run_dir, state) is None
    stand_in(clients, "sacct", SACCT_OUT_OF_MEMORY)
    assert diagnose(run_dir, state).message.startswith("killed by Slurm for memory")


def test_an_over_memory_kill_is_named_from_slurmsteps_line_in_the_jobs_output(tmp_path, clients):
    """OverMemoryKill (no cgroup): Slurm says FAILED, ExitCode 0:9; the job's output file says why."""
    run_dir = killed_run(tmp_path, slurm={"job_id": "1", "cluster": "bigmemtest", "mem_mib": 400})
    (run_dir / "memory.csv").unlink()  # killed before its first sample, as it was
    log = tmp_path / "elsewhere.out"
    log.write_text(OVER_MEMORY_KILL_LOG)
    stand_in(clients, "sacct", SACCT_NO_ACCOUNTING, exit_code=1)
    stand_in(clients, "scontrol", SCONTROL_OVER_MEMORY_KILL.format(log=log))
    said = "'StepId=1.batch exceeded memory limit (462499840 > 419430400), being killed'"
    assert finished_detail(run_dir) == (
        "killed by Slurm for memory at about 0.43 GiB (job 1 FAILED, --mem 400M; planned 0.45 GiB) "
        f"(scontrol says job 1 FAILED, ExitCode 0:9; the job's output file says {said}); 1 of 3 epochs finished"
    )
    # scontrol's StdOut cut short at a space (one line of fields): submit's log beside the run directory.
    (run_dir.parent / "run.slurm-1.out").write_text(OVER_MEMORY_KILL_LOG)
    stand_in(
        clients, "scontrol", SCONTROL_OVER_MEMORY_KILL.format(log="/shared/lab share/results/run.slurm-1.out")
    )
    assert finished_detail(run_dir).startswith(
        f"killed by Slurm for memory at about 0.43 GiB (job 1 FAILED, --mem 400M; planned 0.45 GiB) "
        f"(scontrol says job 1 FAILED, ExitCode 0:9; the job's output file says {said})"
    )
    # Neither client answers (the controller forgot the job): the log beside the run directory says it.
    (clients / "scontrol").unlink()
    assert finished_detail(run_dir) == (
        "killed by Slurm for memory at about 0.43 GiB (job 1, --mem 400M; planned 0.45 GiB) "
        f"(the job's output file says {said}); 1 of 3 epochs finished"
    )
    # A job that ended otherwise has no such line: not taken for memory.
    (run_dir.parent / "run.slurm-1.out").write_text(OVER_MEMORY_KILL_LOG.splitlines()[0] + "\n")
    assert finished_detail(run_dir).startswith("the process ended without a record")
