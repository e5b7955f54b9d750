"""The memory guard and the OOM record for real: a run in a memory cgroup with a limit (made by the test,
as root, under this process's own cgroup), real training, the kernel's limit and OOM killer.

* Guard: another tenant of the run's cgroup takes memory after the first epoch, so the cgroup's charge
  heads for the limit; the guard (judging the cgroup's working set, which RSS alone would not show) stops
  the run at a step boundary with exit 3, no OOM kill, and a rerun with a smaller batch resumes from the
  checkpoint without losing a finished epoch.
* OOM kill: the planner is made wrong (a calibration file whose constants are far too small), so preflight
  accepts a limit far below the run's real peak; the kernel kills the run before the guard can act, and
  ``bigmem-train validate`` names the kill from the cgroup's OOM counter.

cgroup v2 runs where this machine has the memory controller on a v2 mount (see tests/fixtures/cgroups.py
for why it may not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bigmem_train.memory.constants import MODEL_VERSION
from tests.fixtures.cgroups import MemoryCgroup, tenant_command, why_not
from tests.fixtures.common import write_tiny_job
from tests.integration.conftest import bigmem

# Trains for real.
pytestmark = pytest.mark.slow

GIB = 1024**3
MIB = 1024**2
GUARDED_EPOCHS = 60


def _config(tmp_path: Path, epochs: int) -> Path:
    path = write_tiny_job(tmp_path / "tiny.yaml", epochs=epochs, learns=True, results=tmp_path / "results")
    path.write_text(path.read_text() + "guard:\n  threshold: 0.9\n")
    return path


def lying_calibration(tmp_path: Path) -> Path:
    """Planner constants far below the truth: the plan says tens of MiB for a job that needs hundreds."""
    path = tmp_path / "calibration.json"
    path.write_text(
        json.dumps(
            {
                "model": MODEL_VERSION,
                "runtime_baseline_bytes": 40 * MIB,
                "activation_factor": 0.1,
                "workspace_factor": 1.0,
                "measured": {},
            }
        )
    )
    return path


def _popen(args, cgroup: MemoryCgroup, env=None) -> subprocess.Popen:
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        preexec_fn=cgroup.join,
    )


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


@pytest.mark.parametrize("version", [1, 2])
def test_guard_stops_before_the_limit_and_the_rerun_resumes(tmp_path, version):
    reason = why_not(version)
    if reason:
        pytest.skip(f"cgroup v{version}: {reason}")
    # Epochs enough that the tenant's slow leak reaches the guard's threshold before the job ends on a fast
    # host too (14 epochs of 0.2 s end about 2.6 s after the first). A fresh-clone CI ended this run with
    # exit 0: its page cache was cold, the trainer's first read of TensorFlow's libraries was charged to the
    # cgroup, and a tenant that judged the charge levelled off below the threshold of the working set (the
    # tenant now judges the working set, as the guard does). The guard stops the run early; the rerun ends it.
    config = _config(tmp_path, epochs=GUARDED_EPOCHS)
    run_dir = tmp_path / "results" / "guarded"
    cgroup = MemoryCgroup(version, f"bigmem-test-{os.getpid()}-guard", 1 * GIB)
    try:
        trainer = _popen(
            [sys.executable, "-m", "bigmem_train.cli", "run", "-c", str(config), "--run-name", "guarded"],
            cgroup,
        )
        # Two lines of history.csv: its header and the first finished epoch.
        tenant = _popen(
            tenant_command(run_dir / "history.csv", 2, cgroup.limit_bytes, slow_mib=8),
            cgroup,
        )
        try:
            stdout, stderr = trainer.communicate(timeout=600)
        finally:
            _end(tenant)
        oom_kills = cgroup.oom_kills()
    finally:
        _end(trainer)
        cgroup.remove()
    assert trainer.returncode == 3, stdout[-2000:] + stderr[-3000:]
    assert oom_kills == 0
    line = stderr.strip().splitlines()[-1]
    assert "memory guard stopped the run" in line
    assert f"cgroup v{version} working set" in line
    for word in ("planned", "measured", "usable"):
        assert word in line, line
    state = json.loads((run_dir / "state.json").read_text())
    assert (state["state"], state["stopped"]) == ("stopped", "memory")
    assert state["measured_bytes"] >= 0.9 * state["usable_bytes"]
    assert state["usable_bytes"] <= 1 * GIB
    # What the line proposes is a smaller job than the one that was stopped, or nothing.
    assert state["largest_fitting_batch"] in (None, 1)
    assert ("largest batch the measurement says fits" in line) == (state["largest_fitting_batch"] == 1)
    finished = len((run_dir / "history.csv").read_text().strip().splitlines()) - 1
    assert finished >= 1
    # The checkpoint is the epoch after the last finished one: none is lost, none is counted twice.
    backup = json.loads((run_dir / "backup" / "training_metadata.json").read_text())
    assert backup["epoch"] == finished
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["memory_measure"] == f"cgroup v{version} working set"
    assert metrics["guard"]["stopped"]["stopped"] == "memory"

    # The rerun with the batch the line suggests (here outside the cgroup) resumes from the checkpoint.
    rerun = bigmem("run", "-c", config, "--run-name", "guarded", "--set", "training.batch_size=1")
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "resuming guarded with a new training.batch_size" in rerun.stdout
    history = (run_dir / "history.csv").read_text().strip().splitlines()[1:]
    epochs = [int(row.split(",")[0]) for row in history]
    assert epochs == list(range(GUARDED_EPOCHS))
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"


@pytest.mark.parametrize("version", [1, 2])
def test_oom_kill_is_named_by_validate(tmp_path, version):
    reason = why_not(version)
    if reason:
        pytest.skip(f"cgroup v{version}: {reason}")
    config = _config(tmp_path, epochs=3)
    # The layer table is cached by a plan outside the cgroup (the planner builds it in a child process).
    assert bigmem("plan", "-c", config).returncode == 0
    calibration = lying_calibration(tmp_path)
    cgroup = MemoryCgroup(version, f"bigmem-test-{os.getpid()}-oom", 300 * MIB)
    try:
        trainer = _popen(
            [sys.executable, "-m", "bigmem_train.cli", "run", "-c", str(config), "--run-name", "killed"],
            cgroup,
            env={"BIGMEM_CALIBRATION": str(calibration)},
        )
        stdout, stderr = trainer.communicate(timeout=600)
        oom_kills = cgroup.oom_kills()
        run_dir = tmp_path / "results" / "killed"
        validated = bigmem("validate", run_dir)
    finally:
        _end(trainer)
        cgroup.remove()
    assert "fits: yes" not in stderr  # preflight accepted it by the plan (no exit 3)
    assert trainer.returncode == -9, stdout[-2000:] + stderr[-2000:]
    assert oom_kills >= 1
    assert json.loads((run_dir / "state.json").read_text())["state"] == "running"
    assert validated.returncode == 1, validated.stdout + validated.stderr
    assert "killed by the out-of-memory killer at about" in validated.stdout
    assert "(planned 0.0" in validated.stdout  # the lying plan: a few tens of MiB
    assert f"cgroup v{version} memory" in validated.stdout  # the evidence: the cgroup's OOM counter
