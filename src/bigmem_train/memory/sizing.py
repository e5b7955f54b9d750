"""Sizing a job to a target: the largest batch, the largest input shape, or both, whose predicted peak
stays within a number of bytes."""

from __future__ import annotations

from bigmem_train.config import MAX_BATCH_SIZE, Config
from bigmem_train.host import HostFacts
from bigmem_train.memory.estimate import breakdown_for
from bigmem_train.sizes import parse_size


def _peak(config: Config, table, calibration, batch: int, shape) -> int:
    return sum(breakdown_for(config, table, calibration, batch, tuple(shape)).values())


def largest_batch(
    config: Config, table, calibration, shape, limit_bytes: int, ceiling: int = MAX_BATCH_SIZE
) -> int:
    """Largest batch whose peak at ``shape`` is at most ``limit_bytes``; 0 when not even 1 fits."""
    if _peak(config, table, calibration, 1, shape) > limit_bytes:
        return 0
    low, high = 1, ceiling
    while low < high:
        middle = (low + high + 1) // 2
        if _peak(config, table, calibration, middle, shape) <= limit_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def largest_shape(
    config: Config,
    table,
    calibration,
    batch: int,
    limit_bytes: int,
    ceiling: tuple[int, int, int] | None = None,
) -> tuple[int, int, int] | None:
    """Largest shape of the configured aspect (edges multiples of 2**depth, at most ``ceiling`` when given)
    whose peak at ``batch`` is at most ``limit_bytes``; None when not even the smallest fits."""
    step = 2**config.model.depth
    base = tuple(config.data.input_shape)

    def fits(shape) -> bool:
        return _peak(config, table, calibration, batch, shape) <= limit_bytes

    def scaled(factor: float) -> tuple[int, int, int]:
        shape = tuple(max(step, int(edge * factor) // step * step) for edge in base)
        if ceiling:
            shape = tuple(min(edge, top) for edge, top in zip(shape, ceiling))
        return shape  # type: ignore[return-value]

    if not fits(scaled(0.0)):
        return None
    low, high = 0.0, 64.0 if ceiling is None else 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if fits(scaled(middle)):
            low = middle
        else:
            high = middle
    shape = list(scaled(low))
    # Fill what is left one step on one axis at a time, the axis furthest below its share first.
    grown = True
    while grown:
        grown = False
        for axis in sorted(range(3), key=lambda a: shape[a] / base[a]):
            trial = list(shape)
            trial[axis] += step
            if ceiling and trial[axis] > ceiling[axis]:
                continue
            if fits(trial):
                shape, grown = trial, True
                break
    return tuple(shape)  # type: ignore[return-value]


def size_to_target(config: Config, target_bytes: int, table, calibration) -> tuple[int, tuple[int, int, int]]:
    """(batch, shape) whose predicted peak comes closest to ``target_bytes`` from below, per footprint.resize.

    "batch" keeps the shape; "shape" keeps the batch; "both" keeps the shape and picks the batch, then
    tries one batch more on a shape shrunk to fit, and takes whichever comes closer (the shape never grows
    beyond the configured one, so crops stay inside the volumes). When nothing fits, the smallest job.
    """
    shape = tuple(config.data.input_shape)
    batch = config.training.batch_size
    mode = config.footprint.resize
    if mode == "batch":
        return max(1, largest_batch(config, table, calibration, shape, target_bytes)), shape
    if mode == "shape":
        found = largest_shape(config, table, calibration, batch, target_bytes)
        step = 2**config.model.depth
        return batch, found or (step, step, step)
    best_batch = largest_batch(config, table, calibration, shape, target_bytes)
    if best_batch == 0:
        found = largest_shape(config, table, calibration, 1, target_bytes, ceiling=shape)
        step = 2**config.model.depth
        return 1, found or (step, step, step)
    candidates = [(best_batch, shape)]
    more = (
        largest_shape(config, table, calibration, best_batch + 1, target_bytes, ceiling=shape)
        if best_batch < MAX_BATCH_SIZE
        else None
    )
    if more:
        candidates.append((best_batch + 1, more))
    return max(candidates, key=lambda c: (_peak(config, table, calibration, c[0], c[1]), c[1] == shape))


def resolve_target(config: Config, host: HostFacts | None) -> int | None:
    """footprint.target in bytes ("80%" of the memory the job may see on ``host``)."""
    if config.footprint.target is None:
        return None
    total = host.limit_total_bytes if host is not None else None
    return parse_size(config.footprint.target, host_total_bytes=total)


def with_job_size(config: Config, batch: int, shape: tuple[int, int, int]) -> Config:
    """A copy of ``config`` with this batch and input shape (validated)."""
    data = config.model_dump()
    data["training"]["batch_size"] = batch
    data["data"]["input_shape"] = tuple(shape)
    return Config.model_validate(data)
