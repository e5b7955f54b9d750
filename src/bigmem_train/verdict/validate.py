"""The verdict of a run, from its files alone: finished, no NaN, loss fell, Dice reached the floor,
peak memory within tolerance of the target (when one is set)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.memory.constants import PLAN_COST_MEASURED, PLAN_COVERAGE, ended_span
from bigmem_train.sizes import format_bytes
from bigmem_train.verdict.postmortem import after_memory_stop, diagnose
from bigmem_train.verdict.rundir import (
    FINISHED,
    read_history,
    read_memory_csv,
    read_record,
    read_state,
    write_json,
)


@dataclass
class Criterion:
    name: str
    passed: bool
    detail: str


@dataclass
class Verdict:
    verdict: str
    criteria: list[Criterion] = field(default_factory=list)
    run_dir: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def failed(self) -> list[Criterion]:
        return [criterion for criterion in self.criteria if not criterion.passed]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MEASURE_NAMES = {"rss": "resident memory, RSS"}

# The plan check passes a job within this many bytes of its plan whatever the share: the same small job
# peaked at 0.95 GiB (host venv, full tensorflow), 0.91 GiB (host venv, tensorflow-cpu) and 0.80 GiB (the
# image) for one plan; that spread is the runtime's own memory, not the planner's model of the job.
PLAN_CHECK_FLOOR_BYTES = 256 * 2**20


def measured_peak(memory: list[dict[str, float]], metrics: dict[str, Any], measure: str = "rss") -> int:
    """The peak of ``measure`` (RSS, or the run's cgroup working set): the larger of metrics.json's figure
    and the memory.csv ``memory`` rows."""
    column, figure = (
        ("rss_bytes", "peak_rss_bytes")
        if measure == "rss"
        else ("working_set_bytes", "peak_cgroup_working_set_bytes")
    )
    return max([int(metrics.get(figure) or 0)] + [int(row.get(column, 0)) for row in memory])


def _history(run_dir: Path) -> list[dict[str, float]]:
    return read_history(run_dir / "history.csv")


EVALUATION_DIR = "evaluation"


def full_size_dice(evaluation: dict[str, Any]) -> tuple[float, int] | None:
    """(Dice pooled over the whole validation volumes, cases) from a run's evaluation.json: the
    foreground's for a binary model, the mean over the classes' for a multiclass one; None without one."""
    summary = evaluation.get("summary") or {}
    if "foreground" in summary:
        row = summary["foreground"]
        return float(row["pooled_dice"]), int(row["cases"])
    classes = [row for name, row in summary.items() if name not in {"whole tumour", "tumour core"}]
    if not classes:
        return None
    return sum(float(row["pooled_dice"]) for row in classes) / len(classes), int(classes[0]["cases"])


def evaluate(run_dir: Path) -> Verdict:
    """Check a run directory and return its verdict (does not write anything)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BadInput(f"run directory {run_dir} does not exist")
    if not (run_dir / "config.yaml").exists():
        raise BadInput(f"{run_dir} is not a bigmem-train run directory (no config.yaml)")
    config = load_config(run_dir / "config.yaml")
    state = read_state(run_dir).get("state", "unknown")
    history = _history(run_dir)
    metrics = read_record(run_dir / "metrics.json")
    criteria: list[Criterion] = []

    state_file = read_state(run_dir)
    finished_detail = f"state {state}, {len(history)} of {config.training.epochs} epochs in history.csv"
    ending = diagnose(run_dir, state_file)
    if ending is not None:
        # state.json says running, but its process is gone: say how it ended.
        finished_detail = f"{ending.message} ({ending.evidence})" if ending.evidence else ending.message
        finished_detail += f"; {len(history)} of {config.training.epochs} epochs finished"
    elif state_file.get("stopped") == "memory":
        finished_detail = f"stopped by the memory guard, checkpoint saved: {state_file.get('message', '')}"
        killed = after_memory_stop(run_dir, state_file)
        if killed is not None:
            # Memory kept growing after the stop: say both, the stop and what ended the process.
            evidence = f" ({killed.evidence})" if killed.evidence else ""
            finished_detail += f"; then, on its way out, {killed.message}{evidence}"
    criteria.append(
        Criterion("finished", state == FINISHED and config.training.epochs <= len(history), finished_detail)
    )

    values = [value for row in history for key, value in row.items() if key != "epoch"]
    nan_count = sum(1 for value in values if not math.isfinite(value))
    criteria.append(
        Criterion(
            "no_nan",
            bool(history) and nan_count == 0,
            f"{nan_count} non-finite values in history.csv" if history else "history.csv is empty",
        )
    )

    losses = [row["loss"] for row in history if "loss" in row]
    if config.validation.require_loss_decrease:
        fell = len(losses) >= 2 and losses[-1] < losses[0]
        detail = (
            f"training loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no training loss recorded"
        )
        criteria.append(Criterion("loss_fell", fell, detail))

    column = "val_hard_dice" if config.validation.dice_metric == "hard" else "val_dice"
    dice = [row[column] for row in history if column in row and math.isfinite(row[column])]
    best = max(dice) if dice else None
    floor = config.validation.dice_floor
    crop = (
        f"best {config.validation.dice_metric} Dice on the {'x'.join(map(str, config.data.input_shape))} "
        f"validation crops {best:.4f}"
        if best is not None
        else f"no validation {config.validation.dice_metric} Dice recorded"
    )
    full_size = full_size_dice(read_record(run_dir / EVALUATION_DIR / "evaluation.json"))
    if full_size is not None:
        # The floor is judged on whole volumes: PASS means the model segments whole scans, borders included.
        value, cases = full_size
        criteria.append(
            Criterion(
                "dice_floor",
                value >= floor,
                f"Dice {value:.4f} on {cases} whole validation volume(s) (best checkpoint, pooled) vs floor "
                f"{floor}; {crop}",
            )
        )
    else:
        criteria.append(
            Criterion(
                "dice_floor",
                best is not None and best >= floor,
                f"{crop} vs floor {floor} (no whole-volume evaluation in {EVALUATION_DIR}/: judged on the crops)",
            )
        )

    memory = read_memory_csv(run_dir / "memory.csv")
    peak = measured_peak(memory, metrics)
    tolerance = config.footprint.tolerance
    # metrics.json is written at the end of training; plan.json before the first step. A run that lost
    # the former is still judged on the plan it was started with, never on fewer criteria.
    plan_record = read_record(run_dir / "plan.json")
    expected_range = plan_record.get("expected_range")  # the range the plan stated (its runs' envelope)
    started = {} if {"target_bytes", "planned_peak_bytes"} <= metrics.keys() else plan_record
    target = metrics.get("target_bytes") or started.get("target_bytes")
    if target:
        # The footprint check judges what the kernel enforces: the run's cgroup working set when its cgroup
        # had a limit, else RSS; metrics.json's ``memory_measure`` says which.
        measure = metrics.get("memory_measure") or "rss"
        judged = measured_peak(memory, metrics, measure)
        distance = abs(judged - target) / target
        if metrics.get("target_is_ceiling"):
            # footprint.levers kept the job (e.g. gradient recomputation at the configured batch and tile):
            # the run passes when it stayed under the target, whatever share of it the kept job needs.
            criteria.append(
                Criterion(
                    "footprint",
                    judged <= target * (1 + tolerance),
                    f"peak {format_bytes(judged)} ({MEASURE_NAMES.get(measure, measure)}) under the target "
                    f"{format_bytes(target)} as a ceiling ({metrics.get('lever') or 'a lever'} kept the job): "
                    f"{judged / target:.1%} of it, tolerance {tolerance:.0%} over",
                )
            )
        else:
            # The plan is the upper envelope of the job's runs and was sized under the target: a run that
            # ends inside the plan's stated range has reached the footprint the target asked for.
            low_end = (expected_range or {}).get("low_bytes")
            in_range = bool(low_end) and low_end <= judged <= target * (1 + tolerance)
            criteria.append(
                Criterion(
                    "footprint",
                    distance <= tolerance or in_range,
                    f"peak {format_bytes(judged)} ({MEASURE_NAMES.get(measure, measure)}) "
                    f"vs target {format_bytes(target)}: "
                    f"{distance:.1%} off, tolerance {tolerance:.0%}"
                    + (f", or in the plan's expected range from {format_bytes(low_end)}" if low_end else ""),
                )
            )
    planned = metrics.get("planned_peak_bytes") or started.get("peak_bytes")
    if not (planned and peak):
        missing = (
            "planned peak (metrics.json, plan.json)"
            if not planned
            else "measured peak (metrics.json, memory.csv)"
        )
        criteria.append(Criterion("plan", False, f"no {missing} recorded: the plan cannot be checked"))
    else:
        criteria.append(plan_criterion(planned, peak, expected_range))

    verdict = "PASS" if all(criterion.passed for criterion in criteria) else "FAIL"
    return Verdict(verdict, criteria, str(run_dir))


def plan_criterion(planned: int, peak: int, expected_range: dict[str, Any] | None) -> Criterion:
    """The plan is the upper envelope of the job's runs (constants.PLAN_COVERAGE): a run above it by more
    than the coverage fails, since preflight would pass a job the host cannot hold; a run below it is
    reported, and fails only past what the runs support (the lower end of the stated range, and no less
    than PLAN_COST_MEASURED, what the scored runs support: a plan further above its runs refuses jobs a
    host can hold). Within PLAN_CHECK_FLOOR_BYTES either way always passes: the runtime's own memory."""
    coverage = (expected_range or {}).get("coverage", PLAN_COVERAGE)
    cost_bound = max((expected_range or {}).get("cost_bound", 0.0), PLAN_COST_MEASURED)
    lowest = 1 - 1 / (1 + cost_bound)
    stated = ""
    if expected_range:
        low, high = expected_range["below"]
        lowest = max(lowest, high)
        stated = f"; runs of this kind {ended_span(low, high, 'their plans')} in calibration"
    above = (peak - planned) / planned
    passed = -lowest <= above <= coverage or abs(planned - peak) <= PLAN_CHECK_FLOOR_BYTES
    side = "above" if above > 0 else "below"
    return Criterion(
        "plan",
        passed,
        f"measured peak {format_bytes(peak)} (RSS) is {abs(above):.1%} {side} the planned "
        f"{format_bytes(planned)}: a run may end at most {coverage:.0%} above its plan and {lowest:.1%} below "
        f"it{stated} (or within {PLAN_CHECK_FLOOR_BYTES / 2**30:.2f} GiB)",
    )


def validate_run(run_dir: Path) -> Verdict:
    """Evaluate and write verdict.json (only for a finished run: an unfinished one must not look finished)."""
    verdict = evaluate(run_dir)
    if read_state(run_dir).get("state") == FINISHED:
        write_json(Path(run_dir) / "verdict.json", verdict.to_dict())
    return verdict


def format_verdict(verdict: Verdict) -> str:
    """The verdict as a person reads it: one line per criterion, then PASS or FAIL and the run."""
    lines = [
        f"  [{'ok' if criterion.passed else 'FAIL'}] {criterion.name}: {criterion.detail}"
        for criterion in verdict.criteria
    ]
    if verdict.passed:
        lines.append(f"PASS {verdict.run_dir}")
    else:
        names = ", ".join(criterion.name for criterion in verdict.failed)
        lines.append(f"FAIL {verdict.run_dir} (failed: {names})")
    return "\n".join(lines)
