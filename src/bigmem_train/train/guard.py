"""The memory guard: stop a run cleanly before the kernel's OOM killer ends it.

The sampler thread hands every memory sample to :class:`MemoryGuard`, which trips when measured memory
(the run's cgroup working set, or RSS without a memory cgroup) passes ``guard.threshold`` of usable
memory, or passes the planned peak by more than ``footprint.tolerance`` while less than ``guard.room`` of
usable memory is left. The Keras callback made by :func:`guard_callback` also looks once at every step
boundary; at the first boundary after a trip it saves the training state into BackupAndRestore's backup
folder (the weights of the steps done so far, and the epoch in progress, so no finished epoch is lost),
and raises :class:`MemoryStopped`: exit 3 with one line naming planned, measured and usable memory and
the largest batch (or input shape) the measurement says would fit. Rerunning with that batch resumes
from the backup (``rundir.prepare_run_dir`` accepts a changed batch size or input shape for a run the
guard stopped; the U-Net's weights do not depend on either).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bigmem_train.config import Config
from bigmem_train.errors import EXIT_DOES_NOT_FIT, BigmemError
from bigmem_train.memory import constants, layers
from bigmem_train.memory.sizing import largest_batch, largest_shape
from bigmem_train.sizes import format_bytes
from bigmem_train.train.monitor import MemoryProbe, MemorySample


class MemoryStopped(BigmemError):
    """The memory guard stopped the run at a step boundary, checkpoint saved (exit 3)."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, message: str, record: dict[str, Any]):
        super().__init__(message)
        self.record = record
        self.run_dir: Path | None = None  # set once the stop is recorded in the run directory


@dataclass
class Trip:
    """Why and at what measurement the guard tripped."""

    reason: str  # "threshold" or "over_plan"
    sample: MemorySample

    def describe(self, guard: MemoryGuard) -> str:
        measured, usable = self.sample.measured_bytes, self.sample.usable_bytes or 0
        if self.reason == "threshold":
            return f"measured memory passed {guard.threshold:.0%} of usable memory"
        return (
            f"measured memory passed the planned peak by more than {guard.tolerance:.0%} with "
            f"{format_bytes(max(0, usable - measured))} left"
        )


class MemoryGuard:
    """Decides from memory samples whether the run must stop; thread-safe (fed by the sampler thread)."""

    def __init__(
        self,
        threshold: float,
        room: float,
        tolerance: float,
        planned_peak_bytes: int | None,
        probe: MemoryProbe,
    ):
        self.threshold = threshold
        self.room = room
        self.tolerance = tolerance
        self.planned_peak_bytes = planned_peak_bytes
        self.probe = probe
        self.trip: Trip | None = None
        self.peak_measured_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, config: Config, planned_peak_bytes: int | None, probe: MemoryProbe) -> MemoryGuard:
        return cls(
            config.guard.threshold, config.guard.room, config.footprint.tolerance, planned_peak_bytes, probe
        )

    def check(self, sample: MemorySample) -> str | None:
        """The reason this sample trips the guard, or None."""
        measured, usable = sample.measured_bytes, sample.usable_bytes
        if not usable:
            return None
        if measured >= self.threshold * usable:
            return "threshold"
        planned = self.planned_peak_bytes
        if planned and measured > planned * (1 + self.tolerance) and usable - measured < self.room * usable:
            return "over_plan"
        return None

    def observe(self, sample: MemorySample) -> None:
        """Take a sample (a sampler listener). The working set between page-table walks subtracts the last
        page-cache figure read; whenever the whole charge (its upper bound) would trip the guard, the
        figure is read afresh and the sample taken again, so a decision never rests on a stale one."""
        self.peak_measured_bytes = max(self.peak_measured_bytes, sample.measured_bytes)
        if self.trip is not None:
            return
        judged_charge = sample.measure != "rss" and sample.charged_bytes is not None
        upper_bound = replace(sample, working_set_bytes=sample.charged_bytes) if judged_charge else sample
        if self.check(upper_bound) is None:
            return
        if judged_charge:
            self.probe.refresh_page_cache()
            sample = self.probe.read()
            self.peak_measured_bytes = max(self.peak_measured_bytes, sample.measured_bytes)
        reason = self.check(sample)
        if reason is not None:
            with self._lock:
                if self.trip is None:
                    self.trip = Trip(reason, sample)

    def look(self) -> Trip | None:
        """One fresh look (at a step boundary) and the trip, if any."""
        if self.trip is None:
            self.observe(self.probe.read())
        return self.trip


def largest_fitting_job(
    config: Config, planned_peak_bytes: int | None, measured_bytes: int, usable_bytes: int
) -> tuple[int, tuple[int, int, int] | None]:
    """(largest batch at this input shape, largest shape at batch 1) that the measurement says would fit.

    The job must shed what it measured above the guard's share of usable memory less the safety margin;
    the planner's peak for the current job less that shortfall is the budget for a smaller one (a shift,
    not a ratio: the planner models resident memory, the measure may be a cgroup working set, and the two
    differ by about a constant, the shared library pages). (0, None) when nothing can be said (no plan).
    """
    if not planned_peak_bytes or not measured_bytes or not usable_bytes:
        return 0, None
    allowed = int(usable_bytes * config.guard.threshold * (1 - config.footprint.safety_margin))
    budget = planned_peak_bytes - max(0, measured_bytes - allowed)
    if budget <= 0:
        return 0, None
    table = layers.layer_table(config)
    calibration = constants.load_calibration()
    shape = tuple(config.data.input_shape)
    batch = min(largest_batch(config, table, calibration, shape, budget), config.training.batch_size - 1)
    fitting_shape = None
    if batch < 1:
        fitting_shape = largest_shape(config, table, calibration, 1, budget, ceiling=shape)
        if fitting_shape == shape:
            fitting_shape = None
    return max(0, batch), fitting_shape


def stop_message(
    trip: Trip,
    guard: MemoryGuard,
    config: Config,
    epoch: int,
    step: int,
    run_name: str,
    batch: int,
    shape: tuple[int, int, int] | None,
) -> str:
    """The one line the run ends with."""
    sample = trip.sample
    planned = guard.planned_peak_bytes
    parts = [
        f"memory guard stopped the run at epoch {epoch + 1}, step {step + 1}: {trip.describe(guard)}",
        f"planned {format_bytes(planned) if planned else 'unknown'}, measured {format_bytes(sample.measured_bytes)} "
        f"({sample.measure}), usable {format_bytes(sample.usable_bytes or 0)}",
        "checkpoint saved (finished epochs kept)",
    ]
    shape_text = "x".join(map(str, config.data.input_shape))
    if batch >= 1:
        parts.append(
            f"largest batch the measurement says fits at {shape_text}: {batch}; resume with "
            f"--set training.batch_size={batch} --run-name {run_name}"
        )
    elif shape is not None:
        parts.append(
            f"not even batch 1 fits at {shape_text}; largest input shape at batch 1: "
            f"{'x'.join(map(str, shape))}; resume with --set training.batch_size=1 "
            f"--set data.input_shape=[{','.join(map(str, shape))}] --run-name {run_name}"
        )
    else:
        parts.append("no smaller batch or shape of this job would fit by the measurement")
    return "; ".join(parts)


def guard_callback(guard: MemoryGuard, backup: Any, config: Config, run_dir: Path):
    """The Keras callback that stops training at the first step boundary after the guard tripped.

    ``backup`` is the run's ``keras.callbacks.BackupAndRestore``: its folder is where a stopped run is
    saved, in its own format, so the next run resumes from it as from any interruption. The stop is
    recorded in state.json as soon as the checkpoint is saved, ``leaving`` until the process has written
    the rest: memory that keeps growing may still get it killed on its way out (postmortem.after_memory_stop).
    """
    import keras

    from bigmem_train.verdict.rundir import STOPPED, set_state

    run_name = run_dir.name

    class _MemoryGuardCallback(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self._stop_if_tripped(batch)

        def on_test_batch_end(self, batch, logs=None):
            # During an epoch's validation: the epoch is not finished (on_epoch_end has not run), so it is
            # the one a resumed run does again.
            self._stop_if_tripped(batch)

        def _stop_if_tripped(self, batch):
            trip = guard.look()
            if trip is None:
                return
            # The epoch in progress is recorded as the one to run again: finished epochs stay finished, and
            # the weights keep the steps done so far. (Keras writes the backup in _save_model; a resumed run
            # sets no _current_epoch until its first epoch ends, so it is set here.)
            backup._current_epoch = self.epoch
            backup._last_batch_seen = batch
            backup._save_model()
            fitting_batch, fitting_shape = largest_fitting_job(
                config,
                guard.planned_peak_bytes,
                max(trip.sample.measured_bytes, guard.peak_measured_bytes),
                trip.sample.usable_bytes or 0,
            )
            message = stop_message(
                trip, guard, config, self.epoch, batch, run_name, fitting_batch, fitting_shape
            )
            record = {
                "stopped": "memory",
                "reason": trip.reason,
                "epoch": self.epoch,
                "step": batch,
                "planned_peak_bytes": guard.planned_peak_bytes,
                "measured_bytes": trip.sample.measured_bytes,
                "usable_bytes": trip.sample.usable_bytes,
                "measure": trip.sample.measure,
                "largest_fitting_batch": fitting_batch or None,
                "largest_fitting_shape": list(fitting_shape) if fitting_shape else None,
                "message": message,
            }
            set_state(run_dir, STOPPED, **record, leaving=True)
            raise MemoryStopped(message, record)

    return _MemoryGuardCallback()
