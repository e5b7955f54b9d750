"""The packaged calibration files hold what the project's fit makes of the runs they store: refitting their
runs (``calibrate.fit_constants`` as ``calibrate.refit`` does) gives back their constants, margins per kind
of job, run ranges and long-run allowance. Arithmetic on recorded layer tables
(tests/fixtures/calibration_tables.py), no TensorFlow."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bigmem_train.memory import calibrate, constants, layers
from bigmem_train.memory.constants import LONG_RUN_GROWTH, MODEL_VERSION
from tests.fixtures import calibration_tables, layer_records

DOCS = Path(__file__).resolve().parents[2] / "docs" / "design" / "planner.md"

# How each packaged file was fitted, as its measured.how says:
# - the EPYC's (avx512+bf16) was refitted on 5 December 2026 the way fit_constants fits now: each job's worst
#   run, margins per kind of job set on runs held out of the fit (issue 38); on 6 December it was replaced by
#   the refit with long runs of its plain calibration jobs stored (measured.long_runs), which fit its
#   long-run allowance (issue 46: benchmarks/results/calibration-long-avx512+bf16.json);
# - the Xeon's (the default) on 3 December 2026, before issue 38: least squares on every run, no envelope
#   margins and no long_run_growth key (load_calibration gives such a file LONG_RUN_GROWTH).
FITTED = {"calibration.avx512+bf16.json": "worst runs, envelope", "calibration.json": "every run"}

# planner.md, "The plan is an envelope": plans fitted on short runs alone add LONG_RUN_GROWTH (10 %).
DOCUMENTED_LONG_RUN_GROWTH = 0.10


@pytest.fixture
def calibration_tables_in_place(monkeypatch):
    """The planner reads the recorded tables of the calibration runs' models instead of building them."""
    monkeypatch.setattr(layer_records, "read_record", calibration_tables.read_record)
    monkeypatch.setattr(layers, "layer_table", layer_records.table_for)


def _every_run_its_own_job(samples):
    """``samples`` with each run named apart (output.run_name, which no estimate reads), so that
    ``fit_worst_runs``, which fits each job's worst run, fits every run: the fit of the files before issue 38."""
    return [
        (
            config.model_copy(update={"output": config.output.model_copy(update={"run_name": f"run-{i}"})}),
            *rest,
        )
        for i, (config, *rest) in enumerate(samples)
    ]


def test_every_packaged_file_stores_its_runs():
    assert sorted(path.name for path in calibration_tables.PACKAGED_FILES) == sorted(FITTED)
    for path in calibration_tables.PACKAGED_FILES:
        data = json.loads(path.read_text())
        assert data["model"] == MODEL_VERSION, path.name
        # 23 jobs (20 float32, 3 mixed_bfloat16), measured 2 or 3 times each.
        assert len(data["measured"]["jobs"]) in (46, 69), path.name


def test_recorded_calibration_tables_are_of_the_model_as_it_is():
    configs = calibration_tables.table_configs()
    assert sorted(path.stem for path in calibration_tables.TABLES_DIR.glob("*.json")) == sorted(configs)
    for name, config in configs.items():
        assert calibration_tables.read_record(name)["key"] == layers._table_key(config), (
            f"{name}: recorded from another model; run PYTHONPATH=src python -m tests.fixtures.calibration_tables "
            "(and refit or recalibrate the packaged files: their runs were of the model before)"
        )


# The candidate constants kept with the results they were scored by (issue 46), shipped since 6 December as the
# EPYC's file: its short runs plus long runs of its plain calibration jobs, the allowance fitted on those
# (python -m bigmem_train.memory.calibrate --refit COPY --add-long ...; docs/results/planner-accuracy.md).
CANDIDATES = {
    Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "calibration-long-avx512+bf16.json": (
        "worst runs, envelope"
    )
}


@pytest.mark.parametrize("name", sorted(FITTED) + sorted(str(path) for path in CANDIDATES))
def test_packaged_constants_are_the_refit_of_their_runs(calibration_tables_in_place, monkeypatch, name):
    path = constants.PACKAGED_CALIBRATION.with_name(name) if name in FITTED else Path(name)
    how = FITTED.get(name) or CANDIDATES[path]
    samples = calibration_tables.packaged_samples(path)
    # Predicted as on the CPU the runs ran on (calibrate.refit does the same), whatever this machine's is.
    with runs_cpu(path):
        if how == "every run":
            refitted, _ = calibrate.fit_worst_runs(_every_run_its_own_job(samples))
            assert not refitted.envelope_margins and not refitted.run_range
        else:
            # Long runs stored with the file (measured.long_runs, issue 46) fit its long-run allowance.
            refitted = calibrate.fit_constants(samples, calibration_tables_long_samples(path) or None)
            assert set(refitted.envelope_margins) == {"plain", "recompute", "mixed"}
    # What the planner reads from the file, not the raw JSON: a key dropped from the file counts too.
    monkeypatch.setenv("BIGMEM_CALIBRATION", str(path))
    loaded = constants.load_calibration()
    assert loaded.source == str(path)
    # The file stores the fit's own rounding (4 decimals for factors and margins, 3 for parameter copies).
    assert loaded.runtime_baseline_bytes == pytest.approx(refitted.runtime_baseline_bytes, abs=1)
    assert loaded.file_backed_bytes == pytest.approx(refitted.file_backed_bytes, abs=1)
    assert loaded.per_convolution_bytes == pytest.approx(refitted.per_convolution_bytes, abs=1)
    for factor in ("activation_factor", "recompute_factor", "mixed_precision_factor", "workspace_factor"):
        assert getattr(loaded, factor) == pytest.approx(getattr(refitted, factor), abs=1e-4), factor
    assert loaded.parameter_copies == pytest.approx(refitted.parameter_copies, abs=1e-3)
    assert loaded.envelope_margins == pytest.approx(refitted.envelope_margins, abs=1e-4)
    assert loaded.envelope_margin == pytest.approx(refitted.envelope_margin, abs=1e-4)
    assert loaded.run_range.keys() == refitted.run_range.keys()
    for kind, pair in refitted.run_range.items():
        assert loaded.run_range[kind] == pytest.approx(pair, abs=1e-4), kind
    assert loaded.run_range_runs == refitted.run_range_runs
    if how != "every run":  # fit_worst_runs alone adds no allowance; such a file gets the floor
        assert loaded.long_run_growth == pytest.approx(refitted.long_run_growth, abs=1e-4)
    assert loaded.long_run_range.keys() == refitted.long_run_range.keys()
    for kind, pair in refitted.long_run_range.items():
        assert loaded.long_run_range[kind] == pytest.approx(pair, abs=1e-4), kind
    assert loaded.long_run_range_runs == refitted.long_run_range_runs
    if not loaded.long_run_range:  # fitted on short runs alone: every plan adds the documented floor
        assert loaded.long_run_growth == DOCUMENTED_LONG_RUN_GROWTH


def runs_cpu(path: Path):
    """Plan as on the CPU the file's runs were measured on (``calibrate.runs_cpu``)."""
    return calibrate.runs_cpu(json.loads(path.read_text())["measured"])


def calibration_tables_long_samples(path):
    """The long runs a packaged file stores (none before issue 46), read as ``calibrate.refit`` reads them."""
    long_runs = json.loads(path.read_text())["measured"].get("long_runs", [])
    return calibrate.samples_of(constants_config(), long_runs)


def constants_config():
    from bigmem_train.config import load_config

    return load_config()


def test_the_long_run_allowance_is_fitted_on_stored_long_runs_and_the_floor_without(
    calibration_tables_in_place, monkeypatch
):
    """A file that stores long runs of its calibration jobs ships the allowance the refit fits on them (the
    EPYC's since 6 December, issue 46); the documented 10 % floor is what a file fitted on short runs alone
    gets (calibrate.fit_constants without long runs; the Xeon's)."""
    text = " ".join(DOCS.read_text().split())
    assert re.search(
        r"plans fitted on short runs alone \(the Xeon's\) add `LONG_RUN_GROWTH` \(10 %, a floor", text
    )
    assert LONG_RUN_GROWTH == DOCUMENTED_LONG_RUN_GROWTH
    epyc = constants.PACKAGED_CALIBRATION.with_name("calibration.avx512+bf16.json")
    shipped = json.loads(epyc.read_text())
    assert shipped["measured"]["long_runs"], "the EPYC's file stores its long runs"
    samples, long_samples = calibration_tables.packaged_samples(epyc), calibration_tables_long_samples(epyc)
    with runs_cpu(epyc):
        fitted = calibrate.fit_constants(samples, long_samples)
        # The same runs without their long runs would get the floor.
        floor = calibrate.fit_constants(samples).long_run_growth
    assert shipped["long_run_growth"] == pytest.approx(fitted.long_run_growth, abs=1e-4)
    assert shipped["long_run_growth"] != DOCUMENTED_LONG_RUN_GROWTH
    assert f"shipped since 6 December: {shipped['long_run_growth'] * 100:.2f} %" in text
    assert floor == DOCUMENTED_LONG_RUN_GROWTH
    xeon = json.loads(constants.PACKAGED_CALIBRATION.read_text())
    assert not xeon["measured"].get("long_runs")
    monkeypatch.setenv("BIGMEM_CALIBRATION", str(constants.PACKAGED_CALIBRATION))
    assert constants.load_calibration().long_run_growth == DOCUMENTED_LONG_RUN_GROWTH


@pytest.mark.slow
def test_recorded_calibration_tables_match_the_model():
    # Builds the models (imports TensorFlow) and checks the recorded tables still describe them.
    for name, config in calibration_tables.table_configs().items():
        assert calibration_tables.record(config) == calibration_tables.read_record(name), name
