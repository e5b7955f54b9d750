"""runtime.heap_limit for real: a whole run held to its plan sets tcmalloc's limit from the plan, the
tolerance and what the process maps outside the heap, says so, records it, and stays under its cap.
(Held below what a job needs, a run fails at an allocation, cleanly or not depending on which allocation
is refused; docs/design/planner.md. tests/unit/test_heap_limit.py shows the allocator's side on its own.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bigmem_train.train.launch import allocator_library
from tests.integration.conftest import bigmem

GIB = 1024**3


@pytest.fixture
def job(tmp_path) -> Path:
    """A job of about 1 GiB, most of it training tensors rather than the runtime."""
    if allocator_library("tcmalloc") is None:
        pytest.skip("tcmalloc is not installed (the heap limit is gperftools')")
    path = tmp_path / "job.yaml"
    job = {
        "data": {
            "source": "synthetic",
            "synthetic_cases": 4,
            "synthetic_shape": [72, 72, 52],
            "input_shape": [64, 64, 48],
        },
        "model": {"depth": 3, "base_filters": 16},
        "training": {"batch_size": 2, "epochs": 2, "steps_per_epoch": 2},
        "validation": {"dice_floor": 0.0, "require_loss_decrease": False},
        "output": {"tensorboard": False, "results_dir": str(tmp_path / "results")},
    }
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def test_a_run_is_held_to_its_plan(job, tmp_path):
    result = bigmem("train", "-c", job, "--run-name", "held", "--set", "runtime.heap_limit=plan")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run_dir = tmp_path / "results" / "held"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    held = metrics["heap_limit"]
    assert metrics["allocator"] == "tcmalloc" and metrics["heap_limit_requested"] == "plan"
    assert held["source"] == "plan + 10%"
    assert held["cap_bytes"] == pytest.approx(plan["peak_bytes"] * 1.10, rel=1e-6)
    assert held["limit_bytes"] == pytest.approx(held["cap_bytes"] - held["outside_heap_bytes"], abs=1 << 20)
    assert 0 < held["outside_heap_bytes"] < held["cap_bytes"]
    assert "memory held to" in result.stdout
    assert metrics["peak_rss_bytes"] <= held["cap_bytes"] * 1.02


def test_a_held_run_that_crashes_is_put_down_to_its_heap_limit(job, tmp_path):
    """A refused allocation inside a kernel ends the process with a segmentation fault (which allocation is
    refused first cannot be chosen); here the test sends the SIGSEGV itself once the run is held, and
    `validate` reads the real run directory: state.json says what the run was held to."""
    command = [sys.executable, "-m", "bigmem_train.cli", "train", "-c", str(job), "--run-name", "crashed"]
    trainer = subprocess.Popen(
        # Epochs enough that it is still training when the test ends it.
        [*command, "--set", "runtime.heap_limit=plan", "--set", "training.epochs=30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    state_path = tmp_path / "results" / "crashed" / "state.json"
    try:
        deadline = time.monotonic() + 300
        state: dict = {}
        while time.monotonic() < deadline and trainer.poll() is None:
            if state_path.exists():
                try:
                    state = json.loads(state_path.read_text())
                except ValueError:  # caught mid-write
                    state = {}
                if state.get("heap_limit"):
                    break
            time.sleep(0.2)
        assert state.get("heap_limit"), "the run never recorded its hold in state.json"
        os.kill(state["pid"], signal.SIGSEGV)
        trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert json.loads(state_path.read_text())["state"] == "running"  # it left no record of its own
    validated = bigmem("validate", state_path.parent)
    assert validated.returncode == 1, validated.stdout + validated.stderr
    assert "while held to" in validated.stdout and "runtime.heap_limit" in validated.stdout
    assert "resume from the last checkpoint" in validated.stdout
