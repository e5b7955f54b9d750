"""How a run whose process is gone ended, from the evidence this host gathers itself
(``postmortem.diagnose``): the boot id (a restart), the recorded process (still running, or gone), and for a
run in a container Docker's State (its OOMKilled flag and exit code). ``docker inspect`` and the host's OOM
counter are stand-ins here (named as such; the container and OOM tests run them for real, slowly); the
boot id, the PID namespace and /proc are this machine's own. Written for the mutants that the fast suite let
live in ``_ending_of_gone_process`` (docs/results/mutation-testing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bigmem_train.verdict import postmortem

HERE_BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
HERE_NS = os.readlink("/proc/self/ns/pid")


def _start_ticks(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19])


def _state(**fields) -> dict:
    return {"state": "running", "boot_id": HERE_BOOT, "host_oom_kills": 5, **fields}


@pytest.fixture
def quiet_host(monkeypatch):
    """The host's OOM kill count has not moved since the run started (5), and no docker CLI answers."""
    monkeypatch.setattr(postmortem, "host_oom_kills", lambda: 5)
    monkeypatch.setattr(postmortem, "inspect_container", lambda identifier: None)


def test_a_run_recorded_under_another_boot_ended_with_the_restart(tmp_path, quiet_host, monkeypatch):
    # Even with the recorded PID alive here (this process), a different boot id means the host restarted.
    state = _state(boot_id="0" * 8, pid=os.getpid(), pid_namespace=HERE_NS)
    monkeypatch.setattr(postmortem, "host_oom_kills", lambda: 99)  # a new boot's count says nothing
    ending = postmortem.diagnose(tmp_path, state)
    assert ending is not None and ending.cause == "rebooted", ending
    assert "the host restarted while the run was running" in ending.message


def test_a_recorded_process_that_still_runs_is_not_diagnosed(tmp_path, quiet_host):
    pid = os.getpid()
    state = _state(pid=pid, pid_namespace=HERE_NS, start_ticks=_start_ticks(pid))
    assert postmortem.diagnose(tmp_path, state) is None
    # The same PID, started at another time, is another process: the run's is gone.
    state["start_ticks"] = _start_ticks(pid) + 1
    ending = postmortem.diagnose(tmp_path, state)
    assert ending is not None and ending.cause == "unknown", ending


def test_a_gone_process_whose_host_oom_count_rose_is_an_oom_kill(tmp_path, quiet_host, monkeypatch):
    state = _state(pid=2**22 + 1, pid_namespace=HERE_NS)  # above pid_max's default: no such process
    monkeypatch.setattr(postmortem, "host_oom_kills", lambda: 6)
    ending = postmortem.diagnose(tmp_path, state)
    assert ending is not None and ending.cause == "oom", ending
    assert "went from 5 to 6" in ending.evidence


@pytest.mark.parametrize(
    "docker_state, cause, words",
    [
        ({"Running": True, "OOMKilled": False, "ExitCode": 0}, None, None),
        (
            {"Running": False, "OOMKilled": True, "ExitCode": 137},
            "oom",
            "the container's OOMKilled flag is set",
        ),
        ({"Running": False, "OOMKilled": False, "ExitCode": 137}, "killed", "killed by signal 9"),
        ({"Running": False, "OOMKilled": False, "ExitCode": 143}, "killed", "killed by signal 15"),
    ],
)
def test_a_run_in_a_container_is_judged_by_dockers_state(
    tmp_path, quiet_host, monkeypatch, docker_state, cause, words
):
    # Recorded in another PID namespace (the container's): this host cannot see the process, only Docker can.
    asked = []
    monkeypatch.setattr(
        postmortem, "inspect_container", lambda identifier: asked.append(identifier) or docker_state
    )
    state = _state(pid=1, pid_namespace="pid:[1]", container_id="c0ffee" * 8)
    ending = postmortem.diagnose(tmp_path, state)
    assert asked == ["c0ffee" * 8]
    if cause is None:
        assert ending is None
        return
    assert ending is not None and ending.cause == cause, ending
    assert words in ending.message + " " + ending.evidence


def test_another_namespace_without_a_container_cannot_tell(tmp_path, quiet_host):
    assert postmortem.diagnose(tmp_path, _state(pid=1, pid_namespace="pid:[1]")) is None


CHILD = (
    "import json; from bigmem_train.verdict.rundir import process_identity; "
    "from bigmem_train.verdict.postmortem import _process_alive; "
    "identity = process_identity(); print(json.dumps([identity, _process_alive(identity)]))"
)


def test_the_recorded_identity_is_this_process_even_with_a_parenthesis_in_its_name(tmp_path):
    """process_identity's start time is field 22 of /proc/PID/stat, counted after the command name, which
    may hold ")" and spaces: a Python started under the name "x) 1 2 3" records the start time psutil
    reads (an independent parser), its host's name and OOM count, and is judged alive by postmortem."""
    import json
    import socket
    import subprocess
    import sys

    import psutil

    odd = tmp_path / "x) 1 2 3"
    odd.symlink_to(sys.executable)
    vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    # Under another name the interpreter does not find its venv: hand it this process's import path.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry)}
    done = subprocess.run(
        [str(odd), "-c", CHILD], capture_output=True, text=True, check=True, timeout=120, env=environment
    )
    identity, alive = json.loads(done.stdout)
    assert alive is True
    assert identity["hostname"] == socket.gethostname()
    # The host's count, read before and after: the suite's other streams may OOM-kill in between.
    after = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    assert int(vmstat["oom_kill"]) <= identity["host_oom_kills"] <= int(after["oom_kill"])
    assert identity["boot_id"] == HERE_BOOT and identity["pid_namespace"] == HERE_NS
    ticks = os.sysconf("SC_CLK_TCK")
    # The child has exited; psutil's reading of its start, done here for a live process of the same name.
    with subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"]) as sleeper:
        try:
            expected = _start_ticks(sleeper.pid)
            created = psutil.Process(sleeper.pid).create_time()
            assert psutil.Process(sleeper.pid).name() == "x) 1 2 3"
            assert abs(expected / ticks + psutil.boot_time() - created) < 0.05
        finally:
            sleeper.kill()
    # The child's own record: a start time in ticks since boot, after this test began and no later than now.
    assert isinstance(identity["start_ticks"], int)
    assert 0 < identity["start_ticks"] <= expected


@pytest.mark.parametrize("version, name", [(1, "memory.max_usage_in_bytes"), (2, "memory.peak")])
def test_a_run_killed_before_its_first_sample_is_sized_by_its_cgroups_high_water_mark(
    tmp_path, quiet_host, version, name
):
    """No memory.csv row: the size at the kill is the cgroup's own peak, from the file of its version (a
    stand-in folder here holds that one file, and the other version's file with another figure)."""
    folder = tmp_path / "cgroup"
    folder.mkdir()
    (folder / name).write_text(f"{3 * 2**30}\n")
    other = "memory.peak" if version == 1 else "memory.max_usage_in_bytes"
    (folder / other).write_text(f"{7 * 2**30}\n")
    state = _state(pid=2**22 + 1, pid_namespace=HERE_NS, cgroup={"version": version, "folder": str(folder)})
    ending = postmortem.diagnose(tmp_path / "run", state)
    assert ending is not None and "at about 3.00 GiB" in ending.message, ending
    (folder / name).write_text("max\n")  # not a figure: said as unknown, not guessed
    ending = postmortem.diagnose(tmp_path / "run", state)
    assert ending is not None and "at an unknown size (no memory sample)" in ending.message, ending
