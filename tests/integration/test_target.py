"""Sizing to a memory target for real: `bigmem-train run --target SIZE` trains a job the planner sized,
and the measured peak stays under the target and under its plan's envelope (the verdict's footprint and
plan criteria)."""

import json
from pathlib import Path

import pytest

from bigmem_train.host import read_host_facts
from bigmem_train.memory.constants import CROSS_CPU_SPREAD, PLAN_COVERAGE, load_calibration

from .conftest import bigmem

pytestmark = pytest.mark.slow

GIB = 1024**3

# A job the planner grows (input shape at batch 1) until its predicted peak reaches the target; few
# steps, since two cores train a ~1M-voxel sample in about a minute a step.
TARGET_JOB = """\
data:
  source: synthetic
  synthetic_cases: 4
  synthetic_shape: [64, 64, 48]
  input_shape: [48, 48, 32]
  validation_fraction: 0.25
  crop_jitter: 0
model:
  depth: 3
  base_filters: 8
training:
  batch_size: 1
  epochs: 1
  steps_per_epoch: 3
  validation_steps: 1
footprint:
  resize: shape
  # The planner's whole-run error at this size is -5..+8 % on this CPU (docs/design/planner.md, Accuracy) and one
  # job varies by up to 6 % between runs: 10 % left no room for both; 15 % still fails a planner that is off.
  tolerance: 0.15
validation:
  dice_floor: 0.0
  require_loss_decrease: false
output:
  results_dir: {results}
  run_name: target
  tensorboard: false
"""


def test_run_sized_to_a_target_peaks_within_tolerance(tmp_path: Path):
    config = tmp_path / "target.yaml"
    config.write_text(TARGET_JOB.format(results=tmp_path / "results"))
    target = "2.5GiB"

    planned = bigmem("plan", "--config", config, "--target", target, "--json", timeout=600)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["target_bytes"] == int(2.5 * GIB)
    assert plan["peak_bytes"] <= plan["target_bytes"]
    assert plan["input_shape"] != [48, 48, 32]  # the planner grew the shape
    assert all(edge % 8 == 0 for edge in plan["input_shape"])

    result = bigmem("run", "--config", config, "--target", target, timeout=3000)
    run_dir = tmp_path / "results" / "target"
    assert (run_dir / "plan.json").is_file(), result.stdout + result.stderr
    recorded = json.loads((run_dir / "plan.json").read_text())
    # The run's plan is the sized plan with its own file-backed part (mapped libraries, measured once
    # TensorFlow was loaded) in place of the calibration's: nothing else moved.
    mapped = recorded["runtime_file_backed"]
    assert (
        recorded["peak_bytes"] - plan["peak_bytes"] == mapped["measured_bytes"] - mapped["calibrated_bytes"]
    )
    assert recorded["input_shape"] == plan["input_shape"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    measured = metrics["peak_rss_bytes"]
    error = (recorded["peak_bytes"] - measured) / measured
    print(
        f"planned {recorded['peak_bytes'] / GIB:.3f} GiB, measured {measured / GIB:.3f} GiB, error {error:+.1%}"
    )
    verdict = json.loads((run_dir / "verdict.json").read_text())
    footprint = [c for c in verdict["criteria"] if c["name"] == "footprint"]
    assert footprint and footprint[0]["passed"], footprint
    # The plan is the upper envelope of the job's runs (at most 3 % above it), sized under target / 1.03:
    # the run does not pass the target. Below, it may end a few % more than its calibration runs did
    # (plan.json expected_range), so its plan criterion (the bound the scored runs support) judges that.
    # Constants fitted without a range of their runs (the Xeon's, the one a CPU without a file of its own
    # gets) record none: there the bound is the plan's 3 % coverage.
    high = (recorded["expected_range"] or {}).get("high_bytes", recorded["peak_bytes"] * (1 + PLAN_COVERAGE))
    target = plan["target_bytes"]
    if other_cpu := load_calibration().cpu_mismatch(read_host_facts()):
        # Constants fitted on another class of CPU (CI's 2-core EPYC without AVX-512 has no file of its own):
        # the plan warns that a job can peak CROSS_CPU_SPREAD apart there, and promises no more. Seen: this
        # job 1.5 % below its plan on one such machine and 5.1 % above it (2.64 GiB, plan 2.51) on another.
        assert other_cpu in (recorded["calibration_warning"] or ""), recorded["calibration_warning"]
        high = recorded["peak_bytes"] * (1 + CROSS_CPU_SPREAD)
        target *= 1 + CROSS_CPU_SPREAD
    assert measured <= high
    assert measured <= target
    assert next(c for c in verdict["criteria"] if c["name"] == "plan")["passed"], verdict
