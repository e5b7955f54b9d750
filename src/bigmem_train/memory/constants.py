"""The planner's machine constants (runtime baseline, activation factor, workspace factor) and the
file they live in: ``$BIGMEM_CALIBRATION``, the user's cache, or the packaged ``calibration.json``.

They are measured by ``bigmem-train plan --calibrate`` (:mod:`bigmem_train.memory.calibrate`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigmem_train.config import Config
from bigmem_train.host import HostFacts, cpu_isa, this_cpu_flags
from bigmem_train.memory.layers import cache_dir


@dataclass
class Calibration:
    """The machine constants of the model, measured by ``bigmem-train plan --calibrate``.

    Each is fitted for one runtime (oneDNN on or off, allocator, TensorFlow version; recorded in
    ``measured``): the kernels decide what a convolution allocates.
    """

    # Resident memory of the training process that does not scale with the job: Python, TensorFlow,
    # oneDNN and its thread pools, the traced graph.
    runtime_baseline_bytes: int = 870 * 1024**2
    # Resident bytes per byte of tensors alive at the backward peak (activations kept for backward and
    # the activation gradients alive with them, ``backward_live_bytes``): 1 would be a perfect allocator
    # and no op temporaries.
    activation_factor: float = 1.0
    # The same for jobs with gradient recomputation (model.recompute), or None: as ``activation_factor``.
    # Fitted on recomputed calibration jobs: rebuilding each block during backward allocates and frees
    # full-size tensors again and again, and the allocator's page heap strands more of them than a plain
    # run does (TensorFlow's own accounting vs RSS, docs/design/planner.md).
    recompute_factor: float | None = None
    # Under runtime.precision mixed_bfloat16, resident bytes per byte the walk counts, as a multiple of the
    # activation (or recompute) factor, or None: 1. Fitted on mixed-precision calibration jobs alone
    # (measured only where the CPU computes bfloat16 natively): Keras runs batch normalization in float32 and
    # casts around it, and oneDNN's bf16 kernels reorder and convert their operands, more than the walk's
    # per-op rules count (docs/design/planner.md, Accuracy).
    mixed_precision_factor: float | None = None
    # Column buffers of TensorFlow's own (Eigen) Conv3D backward kernels (runtime.onednn false), as a
    # multiple of the largest convolution's patch matrix for one sample (``workspace_reference_bytes``):
    # about 1, those kernels build that matrix a sample or two at a time. oneDNN's build none: a
    # calibration under oneDNN cannot measure it and keeps this built-in value, used only by jobs with
    # oneDNN off.
    workspace_factor: float = 1.0
    # Float32 copies of each trainable parameter a whole run holds beyond the weights, their gradients and
    # Adam's two slots: oneDNN's reordered weights, Adam's update temporaries (and, until model 6, Keras'
    # checkpoint writer's staging buffers: 7.0 copies then, 0.6 with checkpoints streamed to disk).
    # Fitted on whole runs (model 4); 0 before.
    parameter_copies: float = 0.0
    # Resident bytes per convolution layer that do not grow with the batch or the shape: oneDNN's cached
    # primitives (JIT code, reordered weights, per-primitive buffers for forward, input and filter
    # gradient) and TensorFlow's graph and kernels for the layer. Fitted on whole runs (model 4); 0 before.
    per_convolution_bytes: int = 0
    # The file-backed part of the baseline (TensorFlow's and Python's mapped libraries, resident in RSS): the
    # calibration runs' mean at their start, or None (files fitted before it was recorded). It is not the
    # job's: the same run maps 324 MiB in one page-cache state and 436 MiB in another (large folios map
    # whole, docs/design/planner.md), so a run measures its own once TensorFlow and the model are loaded and its
    # plan trades this figure for it (``JobPlan.with_file_backed``).
    file_backed_bytes: int | None = None
    # The plan is the upper envelope of a job's runs, not their middle (``PLAN_COVERAGE``): this share of
    # the fitted estimate is added to a plan, the least that keeps each calibration run of the job's kind
    # (``run_kind``) within the coverage of its plan (``calibrate.envelope``). Kinds part differently (a
    # recomputed job up to 16 %, a plain one a few %), so each has its own; ``envelope_margin`` is the
    # largest, for a kind the calibration did not run. 0 and {} for files fitted before they existed.
    envelope_margin: float = 0.0
    envelope_margins: dict[str, float] = field(default_factory=dict)
    # Where runs end against their plan, per kind of job (``run_kind``): [least, most] below the plan as
    # a fraction of it (negative: above it), over the calibration runs of that kind; and how many runs.
    run_range: dict[str, list[float]] = field(default_factory=dict)
    run_range_runs: dict[str, int] = field(default_factory=dict)
    # How far a long run's peak climbs past the peak of the short whole runs the constants were fitted on
    # (``LONG_RUN_GROWTH``), a share of the plan added on top of the margin. 0 here (an estimate of the
    # fitted figure itself); a calibration file fitted on short runs carries LONG_RUN_GROWTH, one that
    # stores long runs the share fitted on them (``calibrate.fit_long_run_growth``).
    long_run_growth: float = 0.0
    # Where long runs (calibration jobs run until their peak stopped climbing, ``long_run_steps`` training
    # steps or more) end against their plans, per kind, as ``run_range`` for the short runs; {} where the
    # allowance was not fitted on long runs (then ``long_run_growth`` is the floor LONG_RUN_GROWTH).
    long_run_range: dict[str, list[float]] = field(default_factory=dict)
    long_run_range_runs: dict[str, int] = field(default_factory=dict)
    long_run_steps: int | None = None
    source: str = "built-in defaults (not calibrated)"
    measured: dict[str, Any] = field(default_factory=dict)
    # Calibration files passed over on the way to this one: fitted for the model before the activation
    # factor (no ``activation_factor``), whose baseline and workspace factor mean something else.
    skipped: list[str] = field(default_factory=list)

    def margin_for(self, config: Config) -> float:
        """The share of the fitted figure added to ``config``'s plan: its kind's envelope margin (else the
        largest), and what a long run climbs past the short runs it was fitted on."""
        margin = self.envelope_margins.get(run_kind(config), self.envelope_margin)
        return (1 + margin) * (1 + self.long_run_growth) - 1

    def expected_range(self, config: Config) -> dict[str, Any] | None:
        """Where a run of ``config``'s kind is expected to end against its plan: {"kind", "below":
        [least, most] fraction below the plan, "runs", "coverage"}; None for constants fitted before
        ranges were recorded."""
        kind = run_kind(config)
        below = self.run_range.get(kind) or self.run_range.get("plain")
        if not below:
            return None
        return {
            "kind": kind if kind in self.run_range else "plain",
            "below": [float(below[0]), float(below[1])],
            "runs": int(self.run_range_runs.get(kind if kind in self.run_range else "plain", 0)),
            "coverage": PLAN_COVERAGE,
            "cost_bound": PLAN_COST_BOUND,
            "long_run_growth": self.long_run_growth,
            # Runs long enough to reach their plateau, where measured for this kind: what a user's run ends at.
            **(
                {
                    "long_below": [float(value) for value in self.long_run_range[kind]],
                    "long_runs": int(self.long_run_range_runs.get(kind, 0)),
                    "long_steps": self.long_run_steps,
                }
                if kind in self.long_run_range
                else {}
            ),
        }

    def warning(self, config: Config, host: HostFacts | None = None) -> str | None:
        """What the plan should warn about these constants for ``config`` on ``host`` (files passed over,
        another runtime, another CPU), or None."""
        warnings = []
        if self.skipped:
            warnings.append(
                f"passed over {', '.join(self.skipped)} (made for the planner's earlier model; "
                "rerun `bigmem-train plan --calibrate`)"
            )
        mismatch = self.runtime_mismatch(config)
        if mismatch:
            warnings.append(mismatch)
        other_cpu = self.cpu_mismatch(host) if host is not None else None
        if other_cpu:
            warnings.append(other_cpu)
        return "; ".join(warnings) or None

    def cpu_mismatch(self, host: HostFacts) -> str | None:
        """Why these constants may not fit ``host``'s CPU, or None (same CPU, or either one unknown).

        oneDNN picks kernels, blockings and their buffers by the CPU: the study's tile at batch 1 peaked
        at 11.60 GiB on a Xeon with AVX-512 and at 10.26 GiB on an EPYC with AVX-512 and bf16, with the
        same software and constants fitted on the Xeon.
        """
        cpu = self.measured.get("cpu") or {}
        fitted_model, fitted_isa = cpu.get("model"), cpu.get("isa")
        if not fitted_model or not host.cpu_model:
            return None
        if fitted_model == host.cpu_model and fitted_isa in (None, host.cpu_isa):
            return None
        return (
            f"fitted on a {fitted_model} ({fitted_isa or 'ISA unknown'}), this host has a {host.cpu_model} "
            f"({host.cpu_isa}): the same job can peak {CROSS_CPU_SPREAD * 100:.0f} % apart on two CPUs; rerun "
            "`bigmem-train plan --calibrate` on this host"
        )

    def runtime_mismatch(self, config: Config) -> str | None:
        """Why these constants may not fit ``config``'s runtime (oneDNN switch, allocator), or None."""
        differences = []
        onednn = self.measured.get("onednn")
        if isinstance(onednn, bool) and onednn != config.runtime.onednn:
            differences.append(f"oneDNN {'on' if onednn else 'off'}")
        allocator = self.measured.get("allocator")
        if allocator and allocator != config.runtime.allocator:
            differences.append(f"allocator {allocator}")
        # Files fitted before runtime.tensor_allocator existed were measured with TensorFlow's BFC pool.
        tensors = self.measured.get("tensor_allocator", "bfc" if self.measured else None)
        if tensors and tensors != config.runtime.tensor_allocator:
            differences.append(f"tensor allocator {tensors}")
        if not differences:
            return None
        return (
            f"fitted with {' and '.join(differences)}, this job runs with oneDNN "
            f"{'on' if config.runtime.onednn else 'off'}, {config.runtime.allocator} and tensor allocator "
            f"{config.runtime.tensor_allocator}; "
            "rerun `bigmem-train plan --calibrate` with its runtime"
        )


# How far apart the same job peaked on two CPUs with the same software and constants (``cpu_mismatch``): the
# study's tile at batch 1, 11.60 GiB on a Xeon with AVX-512 against 10.26 GiB on an EPYC with AVX-512 and bf16.
# On a CPU the constants were not fitted on, a plan's coverage (PLAN_COVERAGE) is not promised: only this.
CROSS_CPU_SPREAD = 0.13

# The plan is what the host must hold: the upper envelope of the job's runs. The same job's peak parts
# from run to run (up to 16 % for a recomputed job, 11 % for a large plain one: tcmalloc keeps freed pages
# in an order set by timing), which is accepted as a property of the runtime (docs/design/planner.md,
# "The plan is an envelope"). Judged on jobs it was not fitted on, run three times each:
# - coverage: no run ends above its plan by more than PLAN_COVERAGE;
# - cost: the plan is above the job's mean run by at most PLAN_COST_BOUND (and by 4 % at the median).
# The verdict's plan criterion and --target sizing follow the same two numbers.
PLAN_COVERAGE = 0.03
PLAN_COST_BOUND = 0.12
# What the scored runs support today (docs/results/planner-accuracy.md): with a margin per kind of job
# (before the long-run allowance), a plain job's plan was up to 11.3 % above its mean short run and a
# recomputed one's up to 22.9 % (recomputed jobs' runs part by up to 16 %, and their plans cover the worst;
# their stated range covers that). The verdict fails a run below its plan only past the stated range and
# 20 % above it (1 - 1/1.2 = 16.7 % below): the 12 % goal would leave a plain batch-4 job no room.
PLAN_COST_MEASURED = 0.20


# A run's peak keeps climbing past its first steps: tcmalloc grows its page heap at a few later steps and
# keeps it. The calibration's whole runs are 2 epochs of 2 steps (calibrate.WHOLE_RUN_EPOCHS); over 16 steps
# the peak rose past the 4-step peak by 3.9 to 9.6 % (four sweep jobs, the largest still rising at step 14)
# and the study's job over 12 steps by 6.5 to 8.4 % (docs/results/planner-accuracy.md, "Long runs";
# benchmarks/long_run_growth.py). A floor from what was measured, added to every plan fitted on short runs
# alone; a calibration file that stores long runs of its jobs fits its own (calibrate.fit_long_run_growth).
LONG_RUN_GROWTH = 0.10


def ended_span(low: float, high: float, plans: str = "it") -> str:
    """Where runs ended against their plans (fractions below; negative: above) in words: "ended 0.4 % to
    6.1 % below it", or "ended between 1.2 % above and 6.8 % below it"."""
    if low < 0:
        return f"ended between {-low * 100:.1f} % above and {high * 100:.1f} % below {plans}"
    return f"ended {low * 100:.1f} % to {high * 100:.1f} % below {plans}"


def run_kind(config: Config) -> str:
    """The kind of job whose runs part alike: "recompute" (blocks rebuilt in backward strand the most
    pages), "mixed" (runtime.precision not float32), else "plain"."""
    if config.model.recompute:
        return "recompute"
    if config.runtime.precision != "float32":
        return "mixed"
    return "plain"


PACKAGED_CALIBRATION = Path(__file__).parent / "calibration.json"


def packaged_calibration_for(isa: str) -> Path:
    """The constants shipped for CPUs of oneDNN instruction-set class ``isa`` (``host.cpu_isa``), where
    they were measured on one (``calibration.<isa>.json`` beside the default, whose own CPU its
    ``measured.cpu`` names): oneDNN picks other kernels and buffers on another class of CPU, and the
    same job peaks differently (``Calibration.cpu_mismatch``)."""
    return PACKAGED_CALIBRATION.with_name(f"calibration.{isa}.json")


# The memory model a calibration file's constants were fitted for (its "model" key): 1 had a workspace
# factor and no activation factor, 2 the activation factor, 3 also counts oneDNN's backward-weights
# scratchpad (``onednn_scratchpad_bytes``), which model 2's activation factor had absorbed; 4 is fitted on
# whole runs (``calibrate.measure_run``: reader, validation, checkpoints, TensorBoard, sampler) instead of a
# bare ``model.fit`` on in-memory data, so its baseline holds what a run adds to the training step; 5 counts
# batch normalization's backward transients (``estimate.BATCH_NORM_BACKWARD_TRANSIENTS``), which model 4's
# activation factor had absorbed (1.089 -> 1.023 on the same runs), and what a recomputed block rebuilds;
# 6 is fitted on runs whose checkpoints are streamed to disk (checkpoints.py: Keras' writer staged each file
# in memory, most of model 5's 7 parameter copies) and has a factor for mixed precision; 7 is fitted on runs
# whose batch normalization is TensorFlow's fused kernel (norm.py), which holds no backward transients; 8 on
# runs whose two shallowest decoder levels are folded (upconv.py, model.fold_upsampling), which keep neither
# the upsampled tensor nor the concatenation; 9 on runs whose folded layers run their gradient's four large
# ops one after another (upconv._folded_sum: side by side, the same job's peak varied by 9 % between runs).
MODEL_VERSION = 9


def _model_version(data: dict[str, Any]) -> int:
    if "activation_factor" not in data:
        return 1
    return int(data.get("model", 2))


def calibration_path_for_user() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration() -> Calibration:
    """$BIGMEM_CALIBRATION, else the user's ``~/.cache/bigmem-train/calibration.json``, else the packaged
    file for this CPU's class (``packaged_calibration_for``) where there is one, else the packaged default.

    A file written by ``plan --calibrate`` for one of the planner's earlier models (``MODEL_VERSION``:
    without ``activation_factor``, or with a factor that also absorbed oneDNN's scratchpad) is passed
    over, and named in ``skipped`` so the plan can say so.
    """
    candidates = []
    if os.environ.get("BIGMEM_CALIBRATION"):
        candidates.append(Path(os.environ["BIGMEM_CALIBRATION"]))
    candidates += [
        calibration_path_for_user(),
        packaged_calibration_for(cpu_isa(this_cpu_flags())),
        PACKAGED_CALIBRATION,
    ]
    skipped = []
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or _model_version(data) < MODEL_VERSION:
            skipped.append(str(path))
            continue
        return Calibration(
            runtime_baseline_bytes=int(data["runtime_baseline_bytes"]),
            activation_factor=float(data["activation_factor"]),
            recompute_factor=(
                None if data.get("recompute_factor") is None else float(data["recompute_factor"])
            ),
            mixed_precision_factor=(
                None if data.get("mixed_precision_factor") is None else float(data["mixed_precision_factor"])
            ),
            workspace_factor=float(data["workspace_factor"]),
            parameter_copies=float(data.get("parameter_copies", 0.0)),
            per_convolution_bytes=int(data.get("per_convolution_bytes", 0)),
            file_backed_bytes=(
                None if data.get("file_backed_bytes") is None else int(data["file_backed_bytes"])
            ),
            envelope_margin=float(data.get("envelope_margin") or 0.0),
            envelope_margins={kind: float(m) for kind, m in (data.get("envelope_margins") or {}).items()},
            run_range={kind: list(pair) for kind, pair in (data.get("run_range") or {}).items()},
            run_range_runs={kind: int(n) for kind, n in (data.get("run_range_runs") or {}).items()},
            # Every file before it was recorded was fitted on short runs (4 training steps).
            long_run_growth=float(data.get("long_run_growth", LONG_RUN_GROWTH)),
            long_run_range={kind: list(pair) for kind, pair in (data.get("long_run_range") or {}).items()},
            long_run_range_runs={kind: int(n) for kind, n in (data.get("long_run_range_runs") or {}).items()},
            long_run_steps=None if data.get("long_run_steps") is None else int(data["long_run_steps"]),
            source=str(path),
            measured=data.get("measured", {}),
            skipped=skipped,
        )
    return Calibration(skipped=skipped)
