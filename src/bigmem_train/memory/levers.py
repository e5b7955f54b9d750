"""Levers: what would make a job fit a number of bytes, cheapest first, each with its predicted peak and
its step-time factor.

Cheapest first means least change to what the job computes: gradient recomputation (the same
mathematics, one more forward pass of each level), mixed bfloat16 where it was measured to save memory
(``BF16_MEMORY_LEVER_KINDS``: with AMX; with AVX512_BF16 alone it is faster but keeps the peak, and without
native bfloat16 oneDNN emulates it, 18x slower here), both together, then a smaller batch, then a smaller
input shape. ``footprint.levers: auto`` applies the cheapest lever that
keeps the job as configured (batch and shape) when the job misses its target; the others are listed in
``bigmem-train plan`` and in preflight's refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bigmem_train.config import Config
from bigmem_train.memory import layers
from bigmem_train.memory.estimate import estimate
from bigmem_train.memory.sizing import largest_batch, largest_shape, with_job_size

# Step-time factors: the lever's step against the kit's default settings, same job, one process each, side
# by side (benchmarks/throughput.py --sections levers; docs/design/performance.md, "Levers"), keyed by how the CPU
# computes bfloat16 (bf16_kind); the study's tile (240x240x144 b1, 16 filters, depth 4; 1 warm-up + 2 steps)
# decides, 96^3 (2 runs of 3 steps each) checks.
# AMX: a 2-vCPU Xeon, quiet (load 0.6-1.9), 3 December 2026: defaults 10.31 s, mixed_bfloat16 5.84 s,
# recompute 15.11 s, both 8.63 s; at 96^3 0.59x, 1.45x and 0.83x.
# AVX512_BF16 without AMX: 2 vCPUs of an AMD EPYC, 3 December 2026 12:48-12:59 UTC (load 1.2-2.2): defaults
# 17.99 s, mixed_bfloat16 12.82 s, recompute 24.34 s, both 15.65 s; at 96^3 (1.83 s) 0.63x, 1.49x, 1.00x.
# Recomputation without native bf16: 1.56x the CPU time per step (96^3, batch 1, 16 filters, float32,
# 2 cores, an earlier session).
RECOMPUTE_STEP_FACTOR = 1.56
STEP_FACTORS: dict[str, dict[str | None, float]] = {
    "recompute": {"amx": 1.47, "avx512_bf16": 1.35, None: RECOMPUTE_STEP_FACTOR},
    "mixed_bfloat16": {"amx": 0.57},
    "recompute + mixed_bfloat16": {"amx": 0.84},
}
# Where bfloat16 is a memory lever: with AMX it kept the tile in 7,375 MiB against 8,394 in float32. With
# AVX512_BF16 and no AMX it is faster (0.71x) but kept 8,532 MiB against 8,440 (the same runs as above), and
# the planner's mixed-precision model, fitted there on jobs of up to 4.6 GiB, planned it at 7,562 MiB (-11 %):
# offered there as a memory lever, it would be a trap. A user who wants its speed sets runtime.precision.
BF16_MEMORY_LEVER_KINDS = frozenset({"amx"})


def bf16_kind(cpu_flags) -> str | None:
    """How this CPU computes bfloat16 natively (oneDNN's AMX and avx512_core_bf16 kernels): "amx",
    "avx512_bf16" (AVX512_BF16 without AMX) or None (not natively: oneDNN would emulate it)."""
    flags = set(cpu_flags or ())
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else None


def step_factor(lever: str, cpu_flags) -> float | None:
    """The measured step-time factor of ``lever`` (a key of STEP_FACTORS) on a CPU with these flags, or None
    where it was not measured on a CPU of that kind."""
    return STEP_FACTORS[lever].get(bf16_kind(cpu_flags))


@dataclass
class Lever:
    """One way to make the job fit: the settings it changes, the job with them, its predicted peak, and
    the factor on the step time it costs (None where it was not measured on a CPU of this kind)."""

    change: str
    config: Config
    peak_bytes: int
    step_time_factor: float | None
    why: str
    keeps_job: bool  # batch and input shape as configured

    def describe(self) -> str:
        factor = (
            f"{self.step_time_factor:.2f}x the step time"
            if self.step_time_factor
            else "step time not measured"
        )
        return f"{self.change}: predicted peak {self.peak_bytes / 2**30:.2f} GiB, {factor} ({self.why})"


def _peak(config: Config, calibration) -> int:
    return sum(estimate(config, calibration).values())


def _with(config: Config, *, recompute: bool | None = None, precision: str | None = None) -> Config:
    data = config.model_dump()
    if recompute is not None:
        data["model"]["recompute"] = recompute
    if precision is not None:
        data["runtime"]["precision"] = precision
    return Config.model_validate(data)


def native_bf16(cpu_flags: list[str] | None) -> bool:
    return bf16_kind(cpu_flags) is not None


def levers_to_fit(
    config: Config, limit_bytes: int, calibration, cpu_flags: list[str] | None = None
) -> list[Lever]:
    """The levers that bring ``config`` to at most ``limit_bytes``, cheapest first (empty when it fits or
    nothing does)."""
    batch, shape = config.training.batch_size, tuple(config.data.input_shape)
    if _peak(config, calibration) <= limit_bytes:
        return []
    found: list[Lever] = []
    candidates = []
    if not config.model.recompute:
        candidates.append(
            (
                "model.recompute: true",
                _with(config, recompute=True),
                step_factor("recompute", cpu_flags),
                "gradient recomputation: the same mathematics, each level's forward pass run again",
            )
        )
    if bf16_kind(cpu_flags) in BF16_MEMORY_LEVER_KINDS and config.runtime.precision == "float32":
        candidates.append(
            (
                "runtime.precision: mixed_bfloat16",
                _with(config, precision="mixed_bfloat16"),
                step_factor("mixed_bfloat16", cpu_flags),
                "bfloat16 activations, float32 weights; this CPU computes bfloat16 on AMX",
            )
        )
        if not config.model.recompute:
            candidates.append(
                (
                    "model.recompute: true and runtime.precision: mixed_bfloat16",
                    _with(config, recompute=True, precision="mixed_bfloat16"),
                    step_factor("recompute + mixed_bfloat16", cpu_flags),
                    "both of the above",
                )
            )
    for change, changed, factor, why in candidates:
        peak = _peak(changed, calibration)
        if peak <= limit_bytes:
            found.append(Lever(change, changed, peak, factor, why, keeps_job=True))
    # Then what changes the job itself: fewer samples a step, or a smaller crop.
    table = layers.layer_table(config)
    fitting_batch = largest_batch(config, table, calibration, shape, limit_bytes, ceiling=max(1, batch - 1))
    if 1 <= fitting_batch < batch:
        smaller = with_job_size(config, fitting_batch, shape)
        found.append(
            Lever(
                f"training.batch_size: {fitting_batch}",
                smaller,
                _peak(smaller, calibration),
                fitting_batch / batch,
                "fewer samples a step: the step time falls with them, the time per sample stays",
                keeps_job=False,
            )
        )
    fitting_shape = largest_shape(config, table, calibration, batch, limit_bytes, ceiling=shape)
    if fitting_shape and fitting_shape != shape:
        smaller = with_job_size(config, batch, fitting_shape)
        found.append(
            Lever(
                f"data.input_shape: [{', '.join(map(str, fitting_shape))}]",
                smaller,
                _peak(smaller, calibration),
                math.prod(fitting_shape) / math.prod(shape),
                "a smaller crop: less context per sample, step time falls with the voxels",
                keeps_job=False,
            )
        )
    return found


def cheapest_keeping_job(levers: list[Lever]) -> Lever | None:
    """The lever ``footprint.levers: auto`` applies: the cheapest that keeps batch and shape."""
    return next((lever for lever in levers if lever.keeps_job), None)
