"""Verdict logic on hand-made run directories: each criterion can fail on its own."""

import json
import re

import pytest

from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.verdict.report import write_report
from bigmem_train.verdict.validate import evaluate, plan_criterion, validate_run

HEADER = "epoch,dice,hard_dice,loss,val_dice,val_hard_dice,val_loss\n"


def make_run(
    tmp_path, rows, state="finished", epochs=None, target=None, peak=None, dice_floor=0.5, planned=None
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    overrides = {"training.epochs": epochs or len(rows), "validation.dice_floor": dice_floor}
    if target:
        overrides["footprint.target"] = str(target)
    (run_dir / "config.yaml").write_text(load_config(None, overrides).to_yaml())
    (run_dir / "state.json").write_text(json.dumps({"state": state}))
    lines = [HEADER] + [f"{i},{d},{d},{loss},{vd},{vd},{loss}\n" for i, (loss, d, vd) in enumerate(rows)]
    (run_dir / "history.csv").write_text("".join(lines))
    # Every real run is planned before it starts: by default the plan was right.
    planned = planned if planned is not None else (peak or 1000)
    metrics = {"peak_rss_bytes": peak or 1000, "target_bytes": target, "planned_peak_bytes": planned}
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    (run_dir / "memory.csv").write_text(
        f"time_unix,elapsed_s,rss_bytes,anon_hugepages_bytes\n1.0,0.0,{peak or 1000},0\n"
    )
    return run_dir


GOOD = [(1.2, 0.1, 0.2), (0.8, 0.4, 0.5), (0.5, 0.7, 0.75)]


def failed_names(run_dir):
    return {criterion.name for criterion in evaluate(run_dir).failed}


def test_good_run_passes_and_writes_verdict(tmp_path):
    run_dir = make_run(tmp_path, GOOD)
    verdict = validate_run(run_dir)
    assert verdict.passed, verdict
    saved = json.loads((run_dir / "verdict.json").read_text())
    assert saved["verdict"] == "PASS"
    assert {c["name"] for c in saved["criteria"]} == {"finished", "no_nan", "loss_fell", "dice_floor", "plan"}


def test_a_run_that_lost_its_metrics_is_judged_on_its_plan_and_memory_record(tmp_path):
    """metrics.json gone: the plan comes from plan.json and the peak from memory.csv; with either gone too,
    the plan criterion fails rather than dropping out of the verdict."""
    run_dir = make_run(tmp_path, GOOD, peak=2 * 2**30, target=2 * 2**30)
    (run_dir / "metrics.json").unlink()
    (run_dir / "plan.json").write_text(
        json.dumps({"peak_bytes": int(1.5 * 2**30), "target_bytes": 2 * 2**30})
    )
    verdict = evaluate(run_dir)
    assert {c.name for c in verdict.criteria} >= {"plan", "footprint"}
    assert {c.name for c in verdict.failed} == {"plan"}  # 1.5 planned against 2.0 measured: -25 %
    (run_dir / "plan.json").unlink()
    plan = next(c for c in evaluate(run_dir).criteria if c.name == "plan")
    assert not plan.passed and "no planned peak" in plan.detail
    (run_dir / "plan.json").write_text(json.dumps({"peak_bytes": 2 * 2**30}))
    (run_dir / "memory.csv").unlink()
    plan = next(c for c in evaluate(run_dir).criteria if c.name == "plan")
    assert not plan.passed and "no measured peak" in plan.detail


def test_loss_that_rose_fails(tmp_path):
    assert failed_names(make_run(tmp_path, [(0.5, 0.6, 0.7), (0.9, 0.6, 0.7)])) == {"loss_fell"}


def test_dice_below_floor_fails(tmp_path):
    assert failed_names(make_run(tmp_path, GOOD, dice_floor=0.9)) == {"dice_floor"}


def test_nan_fails(tmp_path):
    assert "no_nan" in failed_names(make_run(tmp_path, [(1.0, 0.5, 0.6), ("nan", 0.5, 0.6), (0.5, 0.6, 0.8)]))


def test_unfinished_run_fails_and_gets_no_verdict_file(tmp_path):
    run_dir = make_run(tmp_path, GOOD, state="running", epochs=10)
    verdict = validate_run(run_dir)
    assert {c.name for c in verdict.failed} == {"finished"}
    assert not (run_dir / "verdict.json").exists()


@pytest.mark.parametrize(
    "peak, passes", [(10 * 2**30, True), (int(10.9 * 2**30), True), (12 * 2**30, False), (8 * 2**30, False)]
)
def test_footprint_within_tolerance_of_target(tmp_path, peak, passes):
    run_dir = make_run(tmp_path, GOOD, target=10 * 2**30, peak=peak)
    assert ("footprint" not in failed_names(run_dir)) is passes


@pytest.mark.parametrize("peak, passes", [(8 * 2**30, True), (int(10.9 * 2**30), True), (12 * 2**30, False)])
def test_a_target_is_a_ceiling_for_a_job_a_lever_kept(tmp_path, peak, passes):
    """footprint.levers kept the study's batch and tile under 120 GiB at 98.6 GiB: 18 % under the target is
    a pass there (the job was not sized to it), over it by more than the tolerance is not."""
    run_dir = make_run(tmp_path, GOOD, target=10 * 2**30, peak=peak)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics.update(target_is_ceiling=True, lever="model.recompute: true")
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    verdict = evaluate(run_dir)
    assert ("footprint" not in {criterion.name for criterion in verdict.failed}) is passes
    detail = next(criterion.detail for criterion in verdict.criteria if criterion.name == "footprint")
    assert "as a ceiling (model.recompute: true kept the job)" in detail


@pytest.mark.parametrize(
    "peak, planned, passes",
    [
        (10 * 2**30, 10 * 2**30, True),
        # The plan is the upper envelope: a run may end at most 3 % above it (coverage)...
        (10 * 2**30, int(9.75 * 2**30), True),
        (10 * 2**30, int(9.6 * 2**30), False),
        # ...and below it by up to the cost the runs support (a plan 20 % above the run: 16.7 % below it).
        (10 * 2**30, int(11.9 * 2**30), True),
        (10 * 2**30, int(12.2 * 2**30), False),
        # A small job: within 0.25 GiB of its plan passes whatever the share (the runtime's own spread).
        (int(0.80 * 2**30), int(0.89 * 2**30), True),
        (int(0.80 * 2**30), int(1.10 * 2**30), False),
    ],
)
def test_every_run_checks_the_plan_against_its_measured_peak(tmp_path, peak, planned, passes):
    run_dir = make_run(tmp_path, GOOD, peak=peak, planned=planned)  # no target set
    criterion = next(c for c in evaluate(run_dir).criteria if c.name == "plan")
    assert criterion.passed is passes
    assert "planned " in criterion.detail and f"measured peak {peak} B" in criterion.detail
    assert "at most 3% above its plan" in criterion.detail
    if not passes:
        assert failed_names(run_dir) == {"plan"}


def test_plan_criterion_takes_the_lower_end_of_the_stated_range(tmp_path):
    """A run below its plan fails only past what the runs support: the range plan.json states, where it is
    wider than the cost bound."""
    planned, peak = int(12.8 * 2**30), 10 * 2**30  # 21.9 % below the plan
    stated = {"kind": "recompute", "below": [-0.01, 0.25], "runs": 12, "coverage": 0.03, "cost_bound": 0.12}
    run_dir = make_run(tmp_path, GOOD, peak=peak, planned=planned)
    assert not next(c for c in evaluate(run_dir).criteria if c.name == "plan").passed
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").exists() else {}
    (run_dir / "plan.json").write_text(json.dumps({**plan, "expected_range": stated}))
    criterion = next(c for c in evaluate(run_dir).criteria if c.name == "plan")
    assert criterion.passed, criterion.detail
    assert "ended between 1.0 % above and 25.0 % below their plans in calibration" in criterion.detail


def test_plan_criterion_edges_and_the_runtimes_floor():
    gib, mib = 2**30, 2**20
    # At most 3 % above the plan: 103 GiB on a 100 GiB plan passes, a byte more fails.
    assert plan_criterion(100 * gib, 103 * gib, None).passed
    assert not plan_criterion(100 * gib, 103 * gib + 1, None).passed
    # Below, down to the stated range's lower end (25 % here, wider than the cost bound's 16.7 %).
    stated = {"below": [0.0, 0.25], "coverage": 0.03, "cost_bound": 0.12}
    assert plan_criterion(100 * gib, 75 * gib, stated).passed
    assert not plan_criterion(100 * gib, 75 * gib - 1, stated).passed
    # Within 256 MiB either way passes, however large the share (a small job's runtime memory).
    assert plan_criterion(gib, gib + 256 * mib, None).passed  # 25 % above
    assert not plan_criterion(gib, gib + 256 * mib + 1, None).passed
    assert plan_criterion(gib, gib - 256 * mib, None).passed  # 25 % below
    assert not plan_criterion(gib, gib - 256 * mib - 1, None).passed


def test_report_shows_the_planned_breakdown_next_to_the_measured_peak(tmp_path):
    run_dir = make_run(tmp_path, GOOD, peak=3 * 2**30, planned=int(2.85 * 2**30))
    plan = {
        "peak_bytes": int(2.85 * 2**30),
        "breakdown": {
            "activations": {"bytes": int(1.5 * 2**30), "gib": 1.5},
            "runtime_baseline": {"bytes": 760 * 2**20, "gib": 0.742},
        },
    }
    (run_dir / "plan.json").write_text(json.dumps(plan))
    text = write_report(run_dir).read_text()
    assert "<td>activations</td><td>1.50 GiB</td>" in text
    assert "<td>runtime baseline</td><td>0.74 GiB</td>" in text
    assert "<th>peak</th><th>2.85 GiB</th><th>3.00 GiB (-5.0% planned vs measured)</th>" in text
    assert "expected range" not in text  # constants fitted before ranges were recorded state none
    plan["expected_range"] = {
        "kind": "plain",
        "below": [0.004, 0.061],
        "runs": 60,
        "coverage": 0.03,
        "low_bytes": int(2.85 * (1 - 0.061) * 2**30),
        "high_bytes": int(2.85 * 1.03 * 2**30),
    }
    (run_dir / "plan.json").write_text(json.dumps(plan))
    text = write_report(run_dir).read_text()
    assert "<td>expected range</td><td>2.68 GiB to 2.94 GiB</td>" in text
    assert "60 calibration runs ended 0.4 % to 6.1 % below it" in text


def test_validate_command_exit_codes(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    good = make_run(tmp_path / "a", GOOD)
    assert main(["validate", str(good)]) == 0
    assert "PASS" in capsys.readouterr().out
    bad = make_run(tmp_path / "b", GOOD, dice_floor=0.99)
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "dice_floor" in out
    assert main(["validate", str(tmp_path / "missing")]) == 2


def test_not_a_run_directory(tmp_path):
    with pytest.raises(BadInput, match="not a bigmem-train run"):
        evaluate(tmp_path)


def test_report_writes_html_and_plots(tmp_path):
    run_dir = make_run(tmp_path, GOOD)
    validate_run(run_dir)
    page = write_report(run_dir)
    text = page.read_text()
    assert "PASS" in text and "training.png" in text and "memory.png" in text
    assert (run_dir / "training.png").stat().st_size > 1000
    assert (run_dir / "memory.png").stat().st_size > 1000


def test_report_rounds_figures_for_a_person(tmp_path):
    """report.html printed metrics.json's floats as they were ("1.4693821668624878 s", "1344175.0")."""
    run_dir = make_run(tmp_path, GOOD)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics.update(
        median_step_seconds=1.4693821668624878,
        voxels_per_second=1344175.0,
        initial_loss=1.2345678901,
        final_loss=0.0987654321,
        best_val_dice=0.87654321,
        best_val_hard_dice=0.912345678,
    )
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    validate_run(run_dir)
    text = write_report(run_dir).read_text()
    assert "<th>Median step time</th><td>1.47 s</td>" in text
    assert "<th>Voxels per second</th><td>1.34 M</td>" in text
    assert "<td>1.2346 -&gt; 0.0988</td>" in text
    assert "<td>0.877 / 0.912</td>" in text
    assert not re.search(r"\d\.\d{6,}", text), re.findall(r"[\d.]*\d\.\d{6,}", text)
    assert "1344175.0" not in text


def test_footprint_passes_a_run_inside_the_plans_expected_range(tmp_path):
    """A job sized to its target ends inside its plan's range: 13 % under the target is its footprint when
    the plan said runs of its kind end that low, and a miss without the range."""
    run_dir = make_run(tmp_path, GOOD, target=20 * 2**30, peak=int(17.4 * 2**30), planned=int(19.0 * 2**30))
    assert "footprint" in failed_names(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").exists() else {}
    stated = {"kind": "plain", "below": [0.018, 0.096], "runs": 48, "coverage": 0.03}
    stated.update(low_bytes=int(19.0 * (1 - 0.096) * 2**30), high_bytes=int(19.0 * 1.03 * 2**30))
    (run_dir / "plan.json").write_text(json.dumps({**plan, "expected_range": stated}))
    assert "footprint" not in failed_names(run_dir)


# Gaps the mutation run found (docs/results/mutation-testing.md): the criteria's edges, hand-set.


def _evaluation(run_dir, summary):
    (run_dir / "evaluation").mkdir()
    (run_dir / "evaluation" / "evaluation.json").write_text(json.dumps({"summary": summary}))


def _criterion(run_dir, name):
    return next(criterion for criterion in evaluate(run_dir).criteria if criterion.name == name)


@pytest.mark.parametrize(("pooled", "passes"), [(0.49, False), (0.5, True), (0.51, True)])
def test_the_dice_floor_is_judged_on_the_whole_volumes_at_its_edge(tmp_path, pooled, passes):
    """The crops reached 0.75; the whole volumes decide, and a Dice equal to the floor passes."""
    run_dir = make_run(tmp_path, GOOD, dice_floor=0.5)
    _evaluation(run_dir, {"foreground": {"pooled_dice": pooled, "cases": 3}})
    dice = _criterion(run_dir, "dice_floor")
    assert dice.passed is passes
    assert f"Dice {pooled:.4f} on 3 whole validation volume(s)" in dice.detail


def test_a_multiclass_floor_is_the_mean_over_the_classes_not_the_brats_regions(tmp_path):
    """Classes 0.9, 0.6 and 0.3: mean 0.6, whatever the regions (which would lift it) say."""
    run_dir = make_run(tmp_path, GOOD, dice_floor=0.55)
    summary = {
        "edema": {"pooled_dice": 0.9, "cases": 2},
        "non-enhancing": {"pooled_dice": 0.6, "cases": 2},
        "enhancing": {"pooled_dice": 0.3, "cases": 2},
        "whole tumour": {"pooled_dice": 0.99, "cases": 2},
        "tumour core": {"pooled_dice": 0.99, "cases": 2},
    }
    _evaluation(run_dir, summary)
    dice = _criterion(run_dir, "dice_floor")
    assert dice.passed and "Dice 0.6000 on 2 whole" in dice.detail
    (run_dir / "config.yaml").write_text(
        load_config(None, {"training.epochs": 3, "validation.dice_floor": 0.61}).to_yaml()
    )
    assert not _criterion(run_dir, "dice_floor").passed


def test_finished_needs_both_the_state_and_every_epoch(tmp_path):
    for name in "abc":
        (tmp_path / name).mkdir()
    # finished state, one epoch short of the config's 4
    assert "finished" in failed_names(make_run(tmp_path / "a", GOOD, epochs=4))
    # every epoch in history, state not finished
    assert "finished" in failed_names(make_run(tmp_path / "b", GOOD, state="running"))
    assert "finished" not in failed_names(make_run(tmp_path / "c", GOOD))


@pytest.mark.parametrize(
    ("losses", "fell"),
    [
        ([1.0], False),  # one epoch: nothing to compare
        ([1.0, 1.0], False),  # equal is not a fall
        ([1.0, 0.9], True),  # two epochs suffice
        ([1.0, 0.5, 0.95], True),  # first against last, not the last two
        ([1.0, 1.2, 1.1], False),  # the last two fell, the run did not
    ],
)
def test_loss_fell_compares_the_last_epoch_with_the_first(tmp_path, losses, fell):
    rows = [(loss, 0.7, 0.75) for loss in losses]
    assert ("loss_fell" not in failed_names(make_run(tmp_path, rows))) is fell


def test_the_floor_reads_the_dice_column_the_config_names(tmp_path):
    """Soft Dice 0.45 and hard Dice 0.8 on the crops (no whole-volume evaluation)."""
    run_dir = make_run(tmp_path, GOOD)
    (run_dir / "history.csv").write_text(
        HEADER + "".join(f"{i},0.4,0.4,{1 - i / 10},0.45,0.8,0.5\n" for i in range(3))
    )
    for metric, passes in (("hard", True), ("soft", False)):
        overrides = {"training.epochs": 3, "validation.dice_floor": 0.5, "validation.dice_metric": metric}
        (run_dir / "config.yaml").write_text(load_config(None, overrides).to_yaml())
        assert _criterion(run_dir, "dice_floor").passed is passes, metric


@pytest.mark.parametrize(
    ("peak", "passes"),
    [(11 * 2**30, True), (11 * 2**30 + 2**20, False), (9 * 2**30, True), (9 * 2**30 - 2**20, False)],
)
def test_the_footprint_tolerance_is_inclusive_on_both_sides(tmp_path, peak, passes):
    """Target 10 GiB, tolerance 10 %: 9 and 11 GiB are in, a MiB beyond either is out."""
    run_dir = make_run(tmp_path, GOOD, target=10 * 2**30, peak=peak, planned=peak)
    assert ("footprint" not in failed_names(run_dir)) is passes
