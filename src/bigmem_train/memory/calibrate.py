"""Measure whole runs and fit the planner's machine constants (``bigmem-train plan --calibrate``).

The truth the planner is held to is a whole run, not a bare ``model.fit``: ``measure_run(config)`` runs
``bigmem-train train`` in a child process, as a user would, on a short run of the same job (two epochs
of two steps, a synthetic NIfTI dataset of the job's shape read through the real pipeline, validation
after each epoch, checkpoints, TensorBoard, the memory sampler; the runtime the launcher sets up:
oneDNN switch, allocator preloaded, threads) and reads the peak resident memory from its metrics.json.
One job per process, so nothing of one run inflates the next.

``calibrate()`` measures small jobs and fits, by least squares, measured - (weights, gradients, Adam
slots, input pipeline, oneDNN's backward-weights scratchpad) = runtime baseline + activation factor x
(tensors alive at the backward peak) [+ workspace factor x one sample's largest patch matrix, with oneDNN
off]; it writes the constants, the model they belong to and the runtime they were measured under to
``~/.cache/bigmem-train/calibration.json`` (or ``$BIGMEM_CALIBRATION``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigmem_train.config import Config, load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import as_cpu, cpu_isa, read_cpu_flags, read_cpu_model
from bigmem_train.memory import layers
from bigmem_train.memory.constants import (
    LONG_RUN_GROWTH,
    MODEL_VERSION,
    PLAN_COVERAGE,
    Calibration,
    calibration_path_for_user,
    run_kind,
)
from bigmem_train.memory.estimate import estimate
from bigmem_train.memory.levers import native_bf16

# Jobs the constants are fitted on, none of them in the accuracy sweep: batches 1..4, 1 and 4 channels,
# 8 to 32 filters, depths 3..5, whole-run peaks from 1.0 to 2.5 GiB. The two larger jobs are there because
# the activation factor is not the same at every size: on jobs of 0.9-1.5 GiB the runtime baseline is
# 60-85 % of the peak and hides it, and fitted on those alone it came out too low for jobs of 2-4 GiB
# (the 160x152x104 job of tests/integration/test_target.py: -7 %). They cost about 5 of the ~13 minutes.
CALIBRATION_JOBS: list[dict[str, Any]] = [
    {"shape": (64, 64, 48), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (128, 64, 32), "batch": 1, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (48, 48, 48), "batch": 4, "filters": 8, "depth": 3, "channels": 4},
    {"shape": (64, 64, 32), "batch": 1, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (64, 64, 48), "batch": 2, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (144, 128, 96), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (112, 112, 96), "batch": 2, "filters": 8, "depth": 4, "channels": 1},
    # Wider models, so the parameter-copies constant is fitted over 0.35-22.6 M parameters, not 0.35-5.6 M.
    {"shape": (64, 64, 32), "batch": 1, "filters": 16, "depth": 5, "channels": 1},
    {"shape": (64, 48, 48), "batch": 2, "filters": 24, "depth": 4, "channels": 1},
    {"shape": (64, 64, 48), "batch": 1, "filters": 32, "depth": 3, "channels": 1},
    {"shape": (96, 96, 48), "batch": 1, "filters": 16, "depth": 3, "channels": 4},
    # Shallow models (fewer convolutions, each with its own kernels) and two larger jobs (2.4-3.7 GiB),
    # where the activation factor, not the baseline, is most of the peak.
    {"shape": (48, 32, 32), "batch": 1, "filters": 8, "depth": 2, "channels": 4},
    {"shape": (64, 64, 32), "batch": 2, "filters": 4, "depth": 2, "channels": 1},
    {"shape": (160, 160, 96), "batch": 1, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (128, 128, 64), "batch": 2, "filters": 16, "depth": 4, "channels": 1},
    # One job at the scale the planner is for (9 GiB, the study's architecture): fitted on jobs of up to
    # 3.3 GiB the activation factor came out so low that the study's tile was planned 12 % under its peak.
    {"shape": (224, 224, 128), "batch": 1, "filters": 16, "depth": 4, "channels": 1},
    # Gradient recomputation (model.recompute), for its own factor: rebuilding each block in backward
    # strands more of the allocator's pages than a plain run (3.3 to 9 GiB planned).
    {"shape": (128, 128, 96), "batch": 2, "filters": 16, "depth": 4, "channels": 1, "recompute": True},
    {"shape": (176, 176, 112), "batch": 2, "filters": 8, "depth": 4, "channels": 4, "recompute": True},
    {"shape": (224, 208, 128), "batch": 1, "filters": 16, "depth": 4, "channels": 1, "recompute": True},
    {"shape": (208, 208, 128), "batch": 2, "filters": 16, "depth": 4, "channels": 1, "recompute": True},
]


def job_config(
    base: Config,
    shape,
    batch: int,
    filters: int,
    depth: int,
    channels: int,
    precision: str = "float32",
    recompute: bool = False,
    classes: int = 1,
) -> Config:
    """``base`` with this job's shape, batch, filters, depth, channels, precision, gradient recomputation
    and classes (1: binary labels; more: multiclass with that many output classes)."""
    data = base.model_dump()
    data["data"]["input_shape"] = tuple(shape)
    data["data"]["channels"] = list(range(channels))
    data["data"]["label_mode"] = "binary" if classes == 1 else "multiclass"
    data["training"]["batch_size"] = batch
    data["model"]["base_filters"] = filters
    data["model"]["depth"] = depth
    data["model"]["recompute"] = recompute
    data["model"]["output_classes"] = classes
    data["runtime"]["precision"] = precision
    data["footprint"]["target"] = None
    return Config.model_validate(data)


# A whole run measured for the planner: two epochs of two steps, validation after each, checkpoints,
# TensorBoard and the memory sampler (the defaults a user gets), on a synthetic dataset of the job's
# shape read through the real NIfTI pipeline. Four cases: three to train on, one to validate.
WHOLE_RUN_EPOCHS = 2
WHOLE_RUN_STEPS = 2
WHOLE_RUN_CASES = 4


def whole_run_config(
    config: Config,
    results_dir: Path,
    run_name: str,
    validation_cases: int = 1,
    epochs: int = WHOLE_RUN_EPOCHS,
) -> Config:
    """``config`` as a short whole run of the same job (model, batch, shape, channels, runtime), trained
    by ``bigmem-train train`` on a synthetic dataset of its input shape kept under ``results_dir``;
    ``validation_cases`` cases validate (one by default: a validation batch of one sample); ``epochs`` of
    ``WHOLE_RUN_STEPS`` steps (more to measure what a longer run climbs to: benchmarks/long_run_growth.py)."""
    data = config.model_dump(mode="json")
    cases = WHOLE_RUN_CASES - 1 + validation_cases
    data["data"].update(
        source="synthetic",
        path=None,
        synthetic_cases=cases,
        synthetic_shape=list(config.data.input_shape),
        validation_fraction=validation_cases / cases,
    )
    data["training"].update(
        epochs=epochs, steps_per_epoch=WHOLE_RUN_STEPS, validation_steps=None, strategy="single"
    )
    data["footprint"].update(target=None, safety_margin=0.02)  # measure what the host can hold
    data["output"].update(results_dir=str(results_dir), run_name=run_name)
    return Config.model_validate(data)


def measure_run(
    config: Config,
    results_dir: Path,
    run_name: str,
    timeout: float = 7200,
    keep: bool = False,
    validation_cases: int = 1,
    epochs: int = WHOLE_RUN_EPOCHS,
) -> dict[str, Any]:
    """Run ``bigmem-train train`` on ``config`` as a short whole run (:func:`whole_run_config`) in a
    child process, as a user would; return its metrics.json (peak resident memory, step times) with
    the wall time. The run directory is removed unless ``keep``."""
    run_config = whole_run_config(config, results_dir, run_name, validation_cases, epochs)
    results_dir.mkdir(parents=True, exist_ok=True)
    config_file = results_dir / f"{run_name}.yaml"
    config_file.write_text(json.dumps(run_config.model_dump(mode="json")))
    run_dir = results_dir / run_name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "bigmem_train.cli", "train", "--config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
        raise BadInput(f"whole run {run_name} failed (exit {result.returncode}): {' | '.join(tail)}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["wall_seconds"] = round(time.monotonic() - started, 1)
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        config_file.unlink(missing_ok=True)
    return metrics


# Mixed-precision jobs (runtime.precision mixed_bfloat16), for their own factor, measured only where the CPU
# computes bfloat16 natively (levers.native_bf16): elsewhere a bf16 job is emulated, slow, and never offered
# as a lever. 1.0 to 4.5 GiB, none of them a sweep job.
MIXED_CALIBRATION_JOBS: list[dict[str, Any]] = [
    {
        "shape": (64, 64, 48),
        "batch": 1,
        "filters": 16,
        "depth": 4,
        "channels": 1,
        "precision": "mixed_bfloat16",
    },
    {
        "shape": (128, 128, 64),
        "batch": 2,
        "filters": 8,
        "depth": 4,
        "channels": 4,
        "precision": "mixed_bfloat16",
    },
    {
        "shape": (192, 176, 128),
        "batch": 1,
        "filters": 16,
        "depth": 4,
        "channels": 1,
        "precision": "mixed_bfloat16",
    },
]


def calibration_jobs(cpu_flags: list[str] | None) -> list[dict[str, Any]]:
    """The jobs ``plan --calibrate`` measures on a CPU with these flags."""
    return CALIBRATION_JOBS + (MIXED_CALIBRATION_JOBS if native_bf16(cpu_flags) else [])


def _solve(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares (normal equations) for a handful of unknowns, without numpy."""
    size = len(rows[0])
    matrix = [
        [sum(r[i] * r[j] for r in rows) for j in range(size)] + [sum(r[i] * t for r, t in zip(rows, targets))]
        for i in range(size)
    ]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(matrix[r][column]))
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        if matrix[column][column] == 0:
            raise BadInput("calibration jobs do not separate the constants; measure jobs of other sizes")
        for other in range(size):
            if other != column:
                ratio = matrix[other][column] / matrix[column][column]
                matrix[other] = [a - ratio * b for a, b in zip(matrix[other], matrix[column])]
    return [matrix[i][size] / matrix[i][i] for i in range(size)]


Sample = tuple[Config, int] | tuple[Config, int, int | None]


def fit_constants(samples: list[Sample], long_runs: list[Sample] | None = None) -> Calibration:
    """The constants fitted on ``samples`` (:func:`fit_worst_runs`), made the upper envelope of the runs
    by :func:`envelope` with margins set on each job as the others predict it (:func:`held_out_ratios`).

    ``samples`` are short whole runs (WHOLE_RUN_EPOCHS x WHOLE_RUN_STEPS), and a long run climbs past them.
    With ``long_runs`` (runs of calibration jobs long enough to reach their plateau, as ``samples`` are
    given), the allowance for that climb is fitted on them (:func:`fit_long_run_growth`) and where they end
    is recorded; without, every plan adds the floor ``LONG_RUN_GROWTH``."""
    fitted, every_run = fit_worst_runs(samples)
    held_out = held_out_ratios(every_run)
    if not long_runs:
        return envelope(dataclasses.replace(fitted, long_run_growth=LONG_RUN_GROWTH), every_run, held_out)
    margins = envelope(dataclasses.replace(fitted, long_run_growth=0.0), every_run, held_out).envelope_margins
    long_every_run = at_file_backed(long_runs, fitted.file_backed_bytes)
    growth = fit_long_run_growth(every_run, long_every_run, margins)
    return envelope(dataclasses.replace(fitted, long_run_growth=growth), every_run, held_out, long_every_run)


def at_file_backed(runs: list[Sample], file_backed: int | None) -> list[tuple[Config, int]]:
    """``runs`` with each peak taken at the calibration's file-backed part ``file_backed`` (peak - its own
    + that), as :func:`fit_worst_runs` takes the short runs; unchanged where either is unknown."""
    return [
        (config, measured - rest[0] + file_backed if file_backed and rest and rest[0] else measured)
        for config, measured, *rest in runs
    ]


def fit_long_run_growth(
    short_runs: list[tuple[Config, int]], long_runs: list[tuple[Config, int]], margins: dict[str, float]
) -> float:
    """The least allowance for what a long run climbs past the short runs: each long run of a calibration
    job against the plan (its kind's margin, no allowance) of constants fitted on the short runs of the
    other jobs, as the margins are set (:func:`held_out_ratios`), so it covers jobs the fit has not seen;
    the allowance keeps every long run within ``PLAN_COVERAGE`` of its plan. ``short_runs`` and
    ``long_runs`` at the same file-backed part (:func:`at_file_backed`)."""
    fitted: dict[str, Calibration] = {}
    ratios = []
    for config, measured in long_runs:
        key = config.model_dump_json()
        if key not in fitted:
            others = [run for run in short_runs if run[0].model_dump_json() != key]
            fitted[key] = fit_worst_runs(others)[0]
        margin = margins.get(run_kind(config), max(margins.values(), default=0.0))
        ratios.append(measured / (sum(estimate(config, fitted[key]).values()) * (1 + margin)))
    return round(max(0.0, max(ratios) / (1 + PLAN_COVERAGE) - 1), 4)


def held_out_ratios(runs: list[tuple[Config, int]]) -> list[float] | None:
    """Each run over its plan by constants fitted without its job (no margin): how far a job the fit has
    not seen ends above the fitted figure, which is what a margin must cover for a user's job. On the
    EPYC's 69 calibration runs, in-sample margins (plain 1.3 %) let a sweep run end 3.6 % above its plan;
    held-out ones (plain 3.06 %) kept all 78 within 3 % (docs/results/planner-accuracy.md). None where
    leaving a job out leaves jobs that do not separate the constants (then the margins are in-sample)."""
    keys = [config.model_dump_json() for config, _ in runs]
    fitted: dict[str, Calibration] = {}
    ratios = []
    for key, (config, measured) in zip(keys, runs):
        if key not in fitted:
            others = [run for other, run in zip(keys, runs) if other != key]
            try:
                fitted[key] = fit_worst_runs(others)[0]
            except (BadInput, IndexError, ZeroDivisionError):
                return None
        ratios.append(measured / sum(estimate(config, fitted[key]).values()))
    return ratios


def fit_worst_runs(
    samples: list[tuple[Config, int] | tuple[Config, int, int | None]],
) -> tuple[Calibration, list[tuple[Config, int]]]:
    """Least squares of measured - (weights, gradients, slots, input, oneDNN scratchpad) = baseline +
    activation factor x (tensors alive at the backward peak; recompute factor for jobs with gradient
    recomputation) + parameter copies x (trainable parameters x
    4 B) + bytes per convolution x convolution layers [+ workspace factor x one sample's largest patch
    matrix, with TensorFlow's own Conv3D kernels only].

    Each job is fitted on its worst (highest) run: the plan is the upper envelope of a job's runs, and
    :func:`envelope` then adds the least margin that keeps every run (not only the worst) within
    ``PLAN_COVERAGE`` of its plan, and records where each kind of job's runs end below it. Returns the
    fitted constants (no margin) and every run, its peak taken at the mean file-backed part (below).

    Each job is weighted by 1 / its measured peak, so the fit minimises relative errors, as the planner is
    judged (and as a margin is set): unweighted, the 8 GiB jobs set every constant and the 0.8 GiB ones
    take what is left. Leaving each calibration job out in turn and predicting it from the others, the mean
    absolute error was 3.9 % weighted against 4.5 % unweighted (40 runs on the EPYC, 1 December 2026); on
    the Xeon runs with checkpoints streamed to disk, 2.7 % weighted (each job's worse run, 2 December).

    Mixed-precision jobs (``runtime.precision`` not float32) fit one constant of their own, with every other
    as the float32 jobs fixed it: ``mixed_precision_factor``, the multiple of the activation (or recompute)
    factor their activations and workspace hold.

    A slope that comes out negative is pinned to 0 and the others refitted (a factor below zero has no
    physical meaning; it happens when the jobs cannot separate the terms).

    A sample may carry a third figure, the run's file-backed RSS at its start (mapped libraries; metrics'
    ``file_backed_at_start_bytes``). When every sample has it, each peak is taken at the samples' mean
    file-backed part (peak - its own + the mean), so the page cache's state does not leak into the
    job-dependent constants, and the mean is kept as ``file_backed_bytes``: the part of the baseline a
    run trades for its own measurement (``JobPlan.with_file_backed``).
    """
    mapped = [sample[2] if len(sample) > 2 else None for sample in samples]
    file_backed = None
    if mapped and all(mapped):
        file_backed = round(sum(mapped) / len(mapped))
        samples = [
            (config, measured - own + file_backed) for (config, measured, *_), own in zip(samples, mapped)
        ]
    else:
        samples = [(config, measured) for config, measured, *_ in samples]
    every_run = samples
    # The plan is the envelope of a job's runs: each job is fitted on its worst (highest) run.
    worst: dict[str, tuple[Config, int]] = {}
    for config, measured in samples:
        key = config.model_dump_json()
        if key not in worst or measured > worst[key][1]:
            worst[key] = (config, measured)
    samples = list(worst.values())

    def features(
        config: Config,
        activation: float = 0.0,
        recompute: float = 0.0,
        workspace: float = 0.0,
        copies: float = 0.0,
        per_convolution: int = 0,
    ) -> int:
        calibration = Calibration(
            runtime_baseline_bytes=0,
            activation_factor=activation,
            recompute_factor=recompute,
            workspace_factor=workspace,
            parameter_copies=copies,
            per_convolution_bytes=per_convolution,
        )
        return sum(estimate(config, calibration).values())

    table, targets, recomputed, mixed = [], [], [], []
    for config, measured in samples:
        if config.runtime.precision != "float32":
            mixed.append((config, measured))
            continue
        rest = features(config)
        weight = 1.0 / measured  # relative errors: every sum below is in fractions of the job's peak
        row = [
            weight * value
            for value in (
                1.0,
                features(config, activation=1.0) - rest,
                features(config, workspace=1.0) - rest,
                features(config, copies=1.0) - rest,
                features(config, per_convolution=2**20) - rest,
            )
        ]
        target = weight * (measured - rest)
        if config.model.recompute:
            recomputed.append((row, weight * (features(config, recompute=1.0) - rest), target))
        else:
            table.append(row)
            targets.append(target)
    # A term the runtime does not have (the column buffer under oneDNN) is 0 for every job: not fitted.
    measurable = [i for i in (1, 2, 3, 4) if any(row[i] for row in table)]
    free = [0] + measurable
    while True:
        solution = _solve([[row[i] for i in free] for row in table], targets)
        values = dict(zip(free, solution))
        negative = [i for i in free[1:] if values[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: values[i]))
    # The recompute factor on the recomputed jobs alone, the other constants as the plain jobs fixed them:
    # it is the one term those jobs add, so it cannot pull the baseline or the per-parameter terms.
    recompute_factor = None
    if recomputed:
        fixed = [sum(values.get(i, 0.0) * row[i] for i in range(5)) for row, _, _ in recomputed]
        live = [column for _, column, _ in recomputed]
        rests = [target - known for (_, _, target), known in zip(recomputed, fixed)]
        recompute_factor = round(sum(a * b for a, b in zip(live, rests)) / sum(a * a for a in live), 4)
    # Under oneDNN the column buffer cannot be measured: keep the built-in factor (about one sample's
    # patch matrix) for plans of jobs that switch oneDNN off, rather than a 0 that was never measured.
    workspace = round(values.get(2, 0.0), 4) if 2 in measurable else Calibration.workspace_factor
    fitted = Calibration(
        runtime_baseline_bytes=int(values[0]),
        activation_factor=round(values.get(1, 0.0), 4),
        # Without recomputed jobs there is nothing to fit: such plans use the activation factor.
        recompute_factor=recompute_factor,
        workspace_factor=workspace,
        parameter_copies=round(values.get(3, 0.0), 3),
        per_convolution_bytes=int(values.get(4, 0.0) * 2**20),
        file_backed_bytes=file_backed,
    )
    if mixed:  # without mixed-precision jobs such plans use the float32 factors
        fitted = dataclasses.replace(fitted, mixed_precision_factor=_mixed_precision_factor(fitted, mixed))
    return fitted, every_run


def envelope(
    fitted: Calibration,
    runs: list[tuple[Config, int]],
    held_out: list[float] | None = None,
    long_runs: list[tuple[Config, int]] | None = None,
) -> Calibration:
    """``fitted`` made the upper envelope of ``runs`` (every calibration run, not only each job's worst):
    per kind of job (``run_kind``), the least margin that keeps every run of that kind within
    ``PLAN_COVERAGE`` of its plan, and where those runs end against their plans, the range ``plan`` states.
    ``held_out`` (:func:`held_out_ratios`), where given, is each run over the plan of constants fitted
    without its job: the margin then covers jobs the fit has not seen, not only those it was fitted on.
    ``long_runs`` (runs that reached their plateau), where given, are not fitted on here: where they end
    against their plans is recorded per kind as ``long_run_range``, the range ``plan`` states first.

    A margin that covered every run outright would put the plan above a job's mean run by the largest
    parting any calibration job showed, for every job; the coverage lets a rare run end up to 3 % above
    the plan instead. One margin for all kinds made plain jobs pay for what recomputed ones part
    (docs/design/planner.md, "The plan is an envelope")."""
    base = dataclasses.replace(fitted, envelope_margin=0.0, envelope_margins={}, long_run_growth=0.0)
    estimates = [sum(estimate(config, base).values()) for config, _ in runs]
    growth = 1 + fitted.long_run_growth  # the plan also holds what a long run climbs past these runs
    ratios = held_out or [measured / planned for (_, measured), planned in zip(runs, estimates)]
    by_kind: dict[str, list[int]] = {}
    for index, (config, _) in enumerate(runs):
        by_kind.setdefault(run_kind(config), []).append(index)
    margins: dict[str, float] = {}
    ranges: dict[str, list[float]] = {}
    for kind, indices in by_kind.items():
        margin = round(max(0.0, max(ratios[i] for i in indices) / (1 + PLAN_COVERAGE) - 1), 4)
        below = [1 - runs[i][1] / (estimates[i] * (1 + margin) * growth) for i in indices]
        margins[kind] = margin
        ranges[kind] = [round(min(below), 4), round(max(below), 4)]
    long_ranges: dict[str, list[float]] = {}
    long_counts: dict[str, int] = {}
    for config, measured in long_runs or []:
        kind = run_kind(config)
        planned = sum(estimate(config, base).values()) * (1 + margins.get(kind, 0.0)) * growth
        below = 1 - measured / planned
        low, high = long_ranges.get(kind, [below, below])
        long_ranges[kind] = [min(low, below), max(high, below)]
        long_counts[kind] = long_counts.get(kind, 0) + 1
    return dataclasses.replace(
        fitted,
        envelope_margin=max(margins.values(), default=0.0),
        envelope_margins=margins,
        run_range=ranges,
        run_range_runs={kind: len(indices) for kind, indices in by_kind.items()},
        long_run_range={kind: [round(low, 4), round(high, 4)] for kind, (low, high) in long_ranges.items()},
        long_run_range_runs=long_counts,
    )


def _mixed_precision_factor(fitted: Calibration, mixed: list[tuple[Config, int]]) -> float:
    """The mixed-precision factor on the mixed jobs alone, every other constant as ``fitted`` (the float32
    jobs) has it: least squares, in fractions of each job's peak, of what their activations and workspace
    really hold against what the float32 factors give them."""
    scaled, rests = [], []
    for config, measured in mixed:
        planned = sum(estimate(config, fitted).values())
        # What the factor scales: the plan with it doubled, less the plan with it at 1.
        doubled = sum(estimate(config, dataclasses.replace(fitted, mixed_precision_factor=2.0)).values())
        live = doubled - planned
        scaled.append(live / measured)
        rests.append((measured - (planned - live)) / measured)
    return round(sum(a * b for a, b in zip(scaled, rests)) / sum(a * a for a in scaled), 4)


def runtime_record(config: Config, measured: dict[str, Any]) -> dict[str, Any]:
    """How the constants were measured: the runtime the measured run really had (its metrics.json)."""
    return {
        "tensorflow": measured.get("tensorflow_version"),
        "threads": [measured.get("intra_op_threads"), measured.get("inter_op_threads")],
        "host_cpus": os.cpu_count(),
        "cpu": {"model": read_cpu_model(), "isa": cpu_isa(read_cpu_flags())},
        "onednn": bool(measured.get("onednn_enabled")),
        "allocator": measured.get("allocator"),
        "tensor_allocator": measured.get("tensor_allocator", "bfc"),
        "requested": {
            "onednn": config.runtime.onednn,
            "allocator": config.runtime.allocator,
            "tensor_allocator": config.runtime.tensor_allocator,
        },
    }


def calibration_data(calibration: Calibration, measured: dict[str, Any]) -> dict[str, Any]:
    """The calibration file's content."""
    return {
        "model": MODEL_VERSION,
        "runtime_baseline_bytes": calibration.runtime_baseline_bytes,
        "activation_factor": calibration.activation_factor,
        "recompute_factor": calibration.recompute_factor,
        "mixed_precision_factor": calibration.mixed_precision_factor,
        "workspace_factor": calibration.workspace_factor,
        "parameter_copies": calibration.parameter_copies,
        "per_convolution_bytes": calibration.per_convolution_bytes,
        "file_backed_bytes": calibration.file_backed_bytes,
        "envelope_margin": calibration.envelope_margin,
        "envelope_margins": calibration.envelope_margins,
        "long_run_growth": calibration.long_run_growth,
        "run_range": calibration.run_range,
        "run_range_runs": calibration.run_range_runs,
        "long_run_range": calibration.long_run_range,
        "long_run_range_runs": calibration.long_run_range_runs,
        # the shortest of the long runs (training steps), which plan states with their range
        "long_run_steps": min((run["steps"] for run in measured.get("long_runs", [])), default=None),
        "measured": measured,
    }


# Each calibration job is measured this many times: the same job's peak varies from one process to the
# next (allocation order), the constants are fitted on each job's worst run and the envelope on all.
CALIBRATION_REPEATS = 3


def measure_jobs(
    base: Config,
    jobs: list[dict[str, Any]],
    workdir: Path,
    repeats: int,
    log: Callable[[str], None] | None = print,
    first_repeat: int = 0,
) -> tuple[list[tuple[Config, int, int | None]], list[dict[str, Any]], dict[str, Any]]:
    """Measure ``jobs`` ``repeats`` times each as short whole runs (:func:`measure_run`), every job once
    before any twice; return the fit's samples, the calibration file's records of them and the last
    run's metrics (its runtime)."""
    samples, records, measured = [], [], {}
    for repeat in range(first_repeat, first_repeat + repeats):
        for index, job in enumerate(jobs):
            config = job_config(base, **job)
            measured = measure_run(config, workdir, f"calibration-{index}-{repeat}")
            samples.append((config, measured["peak_rss_bytes"], measured.get("file_backed_at_start_bytes")))
            records.append(
                {
                    **{k: list(v) if isinstance(v, tuple) else v for k, v in job.items()},
                    "peak_rss_bytes": measured["peak_rss_bytes"],
                    "file_backed_at_peak_bytes": measured.get("file_backed_at_peak_bytes"),
                    "file_backed_at_start_bytes": measured.get("file_backed_at_start_bytes"),
                }
            )
            if log:
                log(
                    f"  measured {job}: peak {measured['peak_rss_bytes'] / 2**30:.3f} GiB "
                    f"({measured['wall_seconds']} s)"
                )
    return samples, records, measured


RECORD_FIGURES = (
    "peak_rss_bytes",
    "file_backed_at_peak_bytes",
    "file_backed_at_start_bytes",
    "date",
    "steps",
)


def long_run_record(measured: dict[str, Any]) -> dict[str, Any]:
    """A calibration file's record of a long run from a record of benchmarks/long_run_growth.py: the job's
    keys, its peak, its file-backed part at the start, its training steps and date."""
    return {
        **measured["job"],
        "peak_rss_bytes": measured["peak_rss_bytes"],
        "file_backed_at_start_bytes": measured.get("file_backed_at_start_bytes"),
        "steps": measured["epochs"] * measured["steps_per_epoch"],
        "date": measured.get("date"),
    }


def samples_of(base: Config, records: list[dict[str, Any]]) -> list[tuple[Config, int, int | None]]:
    """The fit's samples from a calibration file's records (the job's keys and its figures)."""
    samples = []
    for record in records:
        job = {key: value for key, value in record.items() if key not in RECORD_FIGURES}
        job["shape"] = tuple(job["shape"])
        samples.append(
            (job_config(base, **job), record["peak_rss_bytes"], record.get("file_backed_at_start_bytes"))
        )
    return samples


def calibrate(
    base: Config | None = None,
    jobs: list[dict[str, Any]] | None = None,
    log: Callable[[str], None] | None = print,
    path: Path | None = None,
    repeats: int = CALIBRATION_REPEATS,
    workdir: Path | None = None,
) -> Path:
    """Measure ``jobs`` (default ``calibration_jobs``: the mixed-precision ones where bf16 is native)
    ``repeats`` times each as short whole runs
    (:func:`measure_run`), fit the constants, store them; return the file."""
    base = base or load_config()
    workdir = workdir or layers.cache_dir() / "calibration-runs"
    samples, records, measured = measure_jobs(
        base, jobs or calibration_jobs(read_cpu_flags()), workdir, repeats, log
    )
    fitted = fit_constants(samples)
    path = path or (
        Path(os.environ["BIGMEM_CALIBRATION"])
        if os.environ.get("BIGMEM_CALIBRATION")
        else calibration_path_for_user()
    )
    data = calibration_data(
        fitted,
        {
            "by": "bigmem-train plan --calibrate",
            "how": f"{len(records)} whole runs ({repeats} of each job), each `bigmem-train train` in its own process: "
            f"{WHOLE_RUN_EPOCHS} epochs of {WHOLE_RUN_STEPS} steps on a synthetic NIfTI dataset read through the "
            "real pipeline, validation each epoch, checkpoints, TensorBoard, the sampler; the run's runtime "
            "(oneDNN switch, allocator preloaded, threads); peak RSS (metrics.json); fitted on each job's "
            "worst run, the envelope on every run",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **runtime_record(base, measured),
            "jobs": records,
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def runs_cpu(measured: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Plan as on the CPU a calibration file's runs were measured on (``measured.cpu.isa``: oneDNN's
    kernels, and so what the planner predicts, differ by ISA); this machine's where the file does not say."""
    isa = (measured.get("cpu") or {}).get("isa")
    return as_cpu(isa) if isa else contextlib.nullcontext()


def refit(
    path: Path,
    added: list[dict[str, Any]],
    note: str | None = None,
    long_runs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Refit the calibration file ``path`` on its stored runs plus ``added`` records (more runs of its
    jobs, as ``measure_jobs`` records them) and rewrite it; return the new constants. The runs and how
    they were measured are kept; ``note`` is appended to its ``how``. ``long_runs`` (:func:`long_run_record`)
    are stored as ``measured.long_runs`` with those already there, and fit the long-run allowance."""
    data = json.loads(path.read_text())
    measured = data["measured"]
    measured["jobs"] = measured["jobs"] + added
    if long_runs:
        measured["long_runs"] = measured.get("long_runs", []) + long_runs
    base = load_config()
    # The runs are predicted as on the CPU they ran on, whichever machine refits them.
    with runs_cpu(measured):
        fitted = fit_constants(
            samples_of(base, measured["jobs"]), samples_of(base, measured.get("long_runs", [])) or None
        )
    if note:
        measured["how"] = f"{measured['how']}; {note}"
    measured["refitted"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    new = calibration_data(fitted, measured)
    path.write_text(json.dumps(new, indent=2) + "\n")
    return {key: value for key, value in new.items() if key != "measured"}


def main(argv: list[str] | None = None) -> int:
    """``python -m bigmem_train.memory.calibrate``: measure more runs of the calibration jobs into a JSON
    lines file, or refit a calibration file on its runs plus such a file (how the shipped constants are
    made from runs taken at different times)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--measure-into", type=Path, metavar="JSONL", help="append one record per run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--refit", type=Path, metavar="CALIBRATION_JSON")
    parser.add_argument(
        "--add", type=Path, metavar="JSONL", help="runs to add to the file's before refitting"
    )
    parser.add_argument(
        "--add-long",
        type=Path,
        metavar="JSONL",
        help="long runs (benchmarks/long_run_growth.py) of calibration jobs to fit the long-run allowance on",
    )
    parser.add_argument("--note", help="appended to the file's measured.how")
    args = parser.parse_args(argv)
    if args.measure_into:
        base = load_config()
        workdir = layers.cache_dir() / "calibration-runs"
        for repeat in range(args.repeats):
            _, records, _ = measure_jobs(base, calibration_jobs(read_cpu_flags()), workdir, 1, print, repeat)
            with args.measure_into.open("a") as stream:
                for record in records:
                    stream.write(json.dumps({**record, "date": time.strftime("%Y-%m-%d")}) + "\n")
    if args.refit:
        added = []
        if args.add:
            added = [json.loads(line) for line in args.add.read_text().splitlines() if line.strip()]
        long_runs = []
        if args.add_long:
            records = [json.loads(line) for line in args.add_long.read_text().splitlines() if line.strip()]
            long_runs = [long_run_record(record) for record in records if record.get("set") == "calibration"]
        print(json.dumps(refit(args.refit, added, args.note, long_runs), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
