"""Real training on synthetic data: the job learns, the run directory is complete, the verdict passes,
and a run killed with SIGKILL resumes where it stopped."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bigmem_train.verdict.validate import evaluate

from .conftest import bigmem

pytestmark = pytest.mark.slow

RUN_FILES = [
    "config.yaml",
    "host.json",
    "plan.json",
    "history.csv",
    "steps.csv",
    "memory.csv",
    "metrics.json",
    "verdict.json",
    "report.html",
    "memory.png",
    "training.png",
    "state.json",
    "checkpoints/last.keras",
    "checkpoints/best.keras",
]


def test_tiny_job_learns_and_passes(tiny_job, tmp_path):
    # oneDNN's own log of the primitives it ran (evidence the kit did not write): a convolution ran in oneDNN.
    result = bigmem("run", "--config", tiny_job, "--run-name", "learn", env={"ONEDNN_VERBOSE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    executed = [line for line in result.stdout.splitlines() if line.startswith("onednn_verbose,")]
    assert any(",exec," in line and "convolution" in line for line in executed), result.stdout[-2000:]
    run_dir = tmp_path / "results" / "learn"
    assert f"PASS {run_dir}" in result.stdout
    for name in RUN_FILES:
        assert (run_dir / name).exists(), name
    assert not (run_dir / "backup").exists(), "BackupAndRestore state should be removed after a finished run"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["best_val_hard_dice"] >= 0.5
    assert metrics["final_loss"] < metrics["initial_loss"]
    assert metrics["peak_rss_bytes"] > 200 * 2**20
    # TensorFlow's libraries are mapped: part of the peak is file-backed, not all of it.
    assert 50 * 2**20 < metrics["file_backed_at_peak_bytes"] < metrics["peak_rss_bytes"]
    assert 50 * 2**20 < metrics["file_backed_at_start_bytes"] <= metrics["file_backed_at_peak_bytes"] * 1.05
    # The run measured what it maps of its libraries and its plan says so.
    plan = json.loads((run_dir / "plan.json").read_text())
    assert 50 * 2**20 < plan["runtime_file_backed"]["measured_bytes"] < metrics["peak_rss_bytes"]
    assert metrics["voxels_per_second"] > 0 and metrics["median_step_seconds"] > 0
    # Every run checks the planner: the whole run's measured peak within footprint.tolerance of the plan.
    verdict = json.loads((run_dir / "verdict.json").read_text())
    plan_check = next(criterion for criterion in verdict["criteria"] if criterion["name"] == "plan")
    assert plan_check["passed"], plan_check["detail"]
    assert metrics["planned_vs_measured_error"] is not None
    # The kit's progress lines, not TensorFlow's start-up noise.
    assert "tracing the training step" in result.stdout and "epoch 1/6 done in" in result.stdout
    assert "absl::InitializeLog" not in result.stderr and "cuInit" not in result.stderr
    # The soft Dice the loss trains (the thresholded one saturates: after one epoch it was already 0.84 in a
    # run whose soft Dice then rose from 0.49 to 0.60).
    with open(run_dir / "history.csv") as handle:
        dice = [float(row["val_dice"]) for row in csv.DictReader(handle)]
    assert max(dice[-3:]) > dice[0] + 0.1, f"validation Dice did not clearly rise: {dice}"
    memory_rows = (run_dir / "memory.csv").read_text().splitlines()
    assert memory_rows[0].startswith("time_unix,elapsed_s,rss_bytes,rss_file_bytes,anon_hugepages_bytes")
    assert len(memory_rows) > 10
    # The stages rerun from files alone and agree.
    assert bigmem("validate", run_dir).returncode == 0
    assert bigmem("report", run_dir).returncode == 0
    # A finished run is never overwritten.
    again = bigmem("run", "--config", tiny_job, "--run-name", "learn")
    assert again.returncode == 2 and "already finished" in again.stderr


def _epochs_logged(path):
    if not path.exists():
        return 0
    return max(0, len(path.read_text().strip().splitlines()) - 1)


def test_killed_run_resumes_instead_of_restarting(tiny_job, tmp_path):
    run_dir = tmp_path / "results" / "resume"
    command = [
        sys.executable,
        "-m",
        "bigmem_train.cli",
        "run",
        "--config",
        str(tiny_job),
        "--run-name",
        "resume",
        "--set",
        "training.epochs=5",
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    deadline = time.time() + 600
    while _epochs_logged(run_dir / "history.csv") < 2 and time.time() < deadline and process.poll() is None:
        time.sleep(0.5)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_time = time.time()
    killed_at = _epochs_logged(run_dir / "history.csv")
    assert 2 <= killed_at < 5
    assert json.loads((run_dir / "state.json").read_text())["state"] == "running"
    assert not (run_dir / "verdict.json").exists()
    assert (run_dir / "backup").exists()
    # The previous epoch's state beside the latest: a kill while the latest was being written resumes from it.
    assert (run_dir / "backup" / "latest.weights.h5.bkp").exists()
    assert evaluate(run_dir).failed[0].name == "finished"

    result = bigmem("run", "--config", tiny_job, "--run-name", "resume", "--set", "training.epochs=5")
    assert result.returncode in (0, 1), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "resuming from backup" in result.stdout
    with open(run_dir / "history.csv") as handle:
        epochs = [int(row["epoch"]) for row in csv.DictReader(handle)]
    # Resumed: every epoch once, in order; a restart would log epoch 0 again.
    assert epochs == list(range(5)), (epochs, result.stdout[-2000:], result.stderr[-2000:])
    with open(run_dir / "steps.csv") as handle:
        second_session_epochs = {
            int(row["epoch"]) for row in csv.DictReader(handle) if float(row["time_unix"]) > killed_time
        }
    # The second session trained only the epochs that were not finished before the kill.
    assert min(second_session_epochs) == killed_at and max(second_session_epochs) == 4, second_session_epochs
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
    assert (run_dir / "verdict.json").exists()
