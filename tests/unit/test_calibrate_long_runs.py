"""The long-run allowance fitted on long runs of calibration jobs (issue 46): the least share that keeps every
long run within the coverage of the plan that constants fitted without its job give it, and the range the
long runs end in, which `plan` states apart from the short runs'. Arithmetic on recorded layer tables."""

from __future__ import annotations

import dataclasses

import pytest

from bigmem_train.cli.output import format_plan
from bigmem_train.config import load_config
from bigmem_train.memory import calibrate, estimate
from bigmem_train.memory.constants import LONG_RUN_GROWTH, PLAN_COVERAGE, Calibration
from bigmem_train.memory.plan import JobPlan, plan_job
from tests.fixtures.common import TEST_CALIBRATION

TRUTH = Calibration(runtime_baseline_bytes=700 * 1024**2, activation_factor=1.2, workspace_factor=0.0)
JOBS = [
    {"shape": (48, 48, 32), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (64, 64, 32), "batch": 1, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (64, 64, 48), "batch": 2, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (48, 48, 32), "batch": 4, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (64, 48, 32), "batch": 2, "filters": 8, "depth": 3, "channels": 1},
]


@pytest.fixture
def tables(recorded_tables):
    """Recorded layer tables instead of building the models."""


def configs():
    base = load_config(None, {})
    return [calibrate.job_config(base, **job) for job in JOBS]


def short_and_long(climbs, worst_short=None):
    """Two short runs of each job (the model's figure, or ``worst_short[i]`` times it, and 4 % under it)
    and one long run that climbed ``climbs[i]`` past the model's figure."""
    short, long = [], []
    for index, (config, climb) in enumerate(zip(configs(), climbs)):
        planned = sum(estimate.estimate(config, TRUTH).values())
        top = worst_short[index] if worst_short else 1.0
        short += [(config, int(planned * top)), (config, int(planned * 0.96))]
        long.append((config, int(planned * (1 + climb))))
    return short, long


def test_the_allowance_is_the_least_that_keeps_every_held_out_long_run_within_the_coverage(tables):
    exact, exact_long = short_and_long([0.02, 0.03, 0.08, 0.05, 0.04])
    # Short runs that follow the model: no margin, and the 8 % climb sets the allowance.
    simple = calibrate.fit_constants(exact, exact_long)
    assert simple.envelope_margins == {"plain": 0.0}
    assert simple.long_run_growth == pytest.approx(1.08 / (1 + PLAN_COVERAGE) - 1, abs=2e-3)
    # Short runs that part from the model by job: judged as the margins are, against constants fitted
    # without the run's job (and its kind's margin), the worst long run ends at the edge of the coverage.
    short, long = short_and_long([0.02, 0.03, 0.08, 0.05, 0.04], worst_short=[1.0, 1.06, 0.97, 1.0, 1.03])
    fitted = calibrate.fit_constants(short, long)
    assert fitted.envelope_margins["plain"] > 0
    ratios = []
    for config, measured in long:
        key = config.model_dump_json()
        others, _ = calibrate.fit_worst_runs([run for run in short if run[0].model_dump_json() != key])
        held_out = dataclasses.replace(
            others, envelope_margins=fitted.envelope_margins, long_run_growth=fitted.long_run_growth
        )
        ratios.append(measured / sum(estimate.estimate(config, held_out).values()))
    assert max(ratios) == pytest.approx(1 + PLAN_COVERAGE, abs=1e-3)
    # Where the long runs end against the plan: the range plan states first, apart from the short runs'.
    plans = [sum(estimate.estimate(config, fitted).values()) for config, _ in long]
    below = [1 - measured / plan for (_, measured), plan in zip(long, plans)]
    assert fitted.long_run_range["plain"] == pytest.approx([min(below), max(below)], abs=1e-4)
    assert fitted.long_run_range_runs == {"plain": len(JOBS)}
    assert fitted.run_range_runs == {"plain": 2 * len(JOBS)}
    short_below = [
        1 - measured / sum(estimate.estimate(config, fitted).values()) for config, measured in short
    ]
    assert fitted.run_range["plain"] == pytest.approx([min(short_below), max(short_below)], abs=1e-3)


def test_long_runs_that_climb_no_higher_than_the_coverage_add_nothing(tables):
    short, long = short_and_long([0.0, 0.01, 0.02, 0.0, 0.01])
    fitted = calibrate.fit_constants(short, long)
    assert fitted.long_run_growth == 0.0
    assert fitted.long_run_range["plain"][0] >= -PLAN_COVERAGE


def test_without_long_runs_every_plan_adds_the_floor(tables):
    short, _ = short_and_long([0.0] * len(JOBS))
    fitted = calibrate.fit_constants(short)
    assert fitted.long_run_growth == LONG_RUN_GROWTH
    assert fitted.long_run_range == {} and fitted.long_run_range_runs == {}


def test_long_runs_are_judged_at_the_calibrations_file_backed_part(tables):
    """A long run that mapped 100 MiB more of its libraries than the short runs did is judged without it."""
    mib = 2**20
    short, long = short_and_long([0.02, 0.03, 0.08, 0.05, 0.04])
    short = [(config, measured + 300 * mib, 300 * mib) for config, measured in short]
    same = calibrate.fit_constants(
        short, [(config, measured + 300 * mib, 300 * mib) for config, measured in long]
    )
    more = calibrate.fit_constants(
        short, [(config, measured + 400 * mib, 400 * mib) for config, measured in long]
    )
    assert same.long_run_growth > 0
    assert more.long_run_growth == pytest.approx(same.long_run_growth, abs=1e-4)
    assert more.long_run_range["plain"] == pytest.approx(same.long_run_range["plain"], abs=1e-4)


def test_a_long_run_record_of_the_benchmark_is_a_calibration_record():
    record = {
        "job": {"shape": [64, 64, 32], "batch": 1, "filters": 16, "depth": 4, "channels": 1},
        "set": "calibration",
        "epochs": 8,
        "steps_per_epoch": 2,
        "peak_rss_bytes": 10,
        "peak_after_step": [9, 10],
        "file_backed_at_start_bytes": 3,
        "load_before": 1.0,
        "date": "2026-12-06",
    }
    stored = calibrate.long_run_record(record)
    assert stored["steps"] == 16 and stored["peak_rss_bytes"] == 10
    ((config, peak, mapped),) = calibrate.samples_of(load_config(), [stored])
    assert (config.data.input_shape, config.model.base_filters, peak, mapped) == ((64, 64, 32), 16, 10, 3)


def test_plan_states_the_long_runs_range_and_tells_short_runs_apart(tables):
    calibration = dataclasses.replace(
        TEST_CALIBRATION,
        envelope_margins={"plain": 0.03, "recompute": 0.09},
        envelope_margin=0.09,
        long_run_growth=0.021,
        run_range={"plain": [0.02, 0.09], "recompute": [0.03, 0.2]},
        run_range_runs={"plain": 48, "recompute": 12},
        long_run_range={"plain": [-0.03, 0.07]},
        long_run_range_runs={"plain": 15},
        long_run_steps=16,
    )
    plan = plan_job(load_config("study"), host=None, calibration=calibration)
    text = format_plan(plan)
    assert (
        "its 15 long calibration runs (16 training steps, past the climb) ended between 3.0 % above and "
        "7.0 % below it; its 48 short ones (4 steps) 2.0 % to 9.0 % below it" in " ".join(text.split())
    )
    stated = plan.to_dict()["expected_range"]
    assert stated["long_below"] == [-0.03, 0.07] and stated["long_runs"] == 15 and stated["long_steps"] == 16
    assert JobPlan.from_dict(plan.config, plan.to_dict()).expected_range == plan.expected_range
    # A kind without long runs states its short runs as before, with the allowance they get.
    recomputed = plan_job(load_config("study", {"model.recompute": True}), host=None, calibration=calibration)
    assert "long_below" not in recomputed.to_dict()["expected_range"]
    assert "its 12 calibration runs ended 3.0 % to 20.0 % below it (short runs" in " ".join(
        format_plan(recomputed).split()
    )
