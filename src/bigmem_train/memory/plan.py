"""The plan of one job: sized to its target, its predicted peak and breakdown, its NUMA placement."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from bigmem_train.config import Config
from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.host import HostFacts
from bigmem_train.memory import constants, layers
from bigmem_train.memory.constants import PLAN_COVERAGE, Calibration, ended_span
from bigmem_train.memory.estimate import breakdown_for
from bigmem_train.memory.levers import Lever, cheapest_keeping_job, levers_to_fit
from bigmem_train.memory.placement import Placement, decide_placement
from bigmem_train.memory.sizing import resolve_target, size_to_target, with_job_size
from bigmem_train.ops.distribute import per_worker_batch_size, planned_workers
from bigmem_train.sizes import format_bytes, gib


@dataclass
class JobPlan:
    """The job after sizing, its predicted peak and breakdown, and its placement."""

    config: Config
    peak_bytes: int
    breakdown: dict[str, int]
    target_bytes: int | None
    placement: Placement
    original_batch_size: int = 0
    original_input_shape: tuple[int, int, int] = (0, 0, 0)
    calibration_source: str = ""
    # Set when the constants were fitted under another runtime (oneDNN switch, allocator) than this job's,
    # or a calibration file was passed over (``Calibration.warning``).
    calibration_warning: str | None = None
    # Multi-worker: the plan is per host (one replica and its share of the global batch each).
    workers: int = 1
    # The lever footprint.levers "auto" applied to reach the target or the host (e.g. "model.recompute: true").
    lever: str | None = None
    # The file-backed part of the runtime baseline (mapped libraries): the calibration's figure, and this
    # run's own once it has measured it (``with_file_backed``); None where unknown.
    file_backed_calibrated_bytes: int | None = None
    file_backed_measured_bytes: int | None = None
    # Where runs of this kind end against the plan (``Calibration.expected_range``): fractions below it,
    # the coverage (how far above it a run may end) and the calibration runs it comes from; None for
    # constants fitted before ranges were recorded.
    expected_range: dict[str, Any] | None = None

    def range_bytes(self) -> tuple[int, int] | None:
        """(lowest, highest) peak a run of this plan is expected to end at, or None."""
        if not self.expected_range:
            return None
        most_below = max(self.expected_range["below"][1], 0.0)
        return (
            int(self.peak_bytes * (1 - most_below)),
            int(self.peak_bytes * (1 + self.expected_range["coverage"])),
        )

    def with_file_backed(self, measured: int) -> JobPlan:
        """This plan with the runtime baseline's file-backed part measured in the training process
        (TensorFlow, the model and the reader loaded), in place of the calibration's.

        What a process maps of its libraries moves with the page cache, not with the job: the same small
        job's first sample held 436 MiB of file-backed RSS on a fresh install, 388-395 MiB half an hour
        later and 324-326 MiB after the page cache was dropped, ~0.1 GiB that is a tenth of a small job
        (docs/design/planner.md, Accuracy).
        Only that part is traded; every job-dependent term stays predicted. Without a calibrated figure the
        plan keeps its baseline and records the measurement."""
        if measured <= 0:
            return self
        previous = self.file_backed_measured_bytes or self.file_backed_calibrated_bytes
        delta = measured - previous if self.file_backed_calibrated_bytes else 0
        breakdown = dict(self.breakdown)
        breakdown["runtime_baseline"] = breakdown.get("runtime_baseline", 0) + delta
        return replace(
            self, breakdown=breakdown, peak_bytes=self.peak_bytes + delta, file_backed_measured_bytes=measured
        )

    @classmethod
    def from_dict(cls, config: Config, data: dict[str, Any]) -> JobPlan:
        """The plan ``to_dict`` wrote (plan.json, the launcher's hand-off) for the sized ``config``."""
        return cls(
            config=config,
            peak_bytes=int(data["peak_bytes"]),
            breakdown={key: int(value["bytes"]) for key, value in data["breakdown"].items()},
            target_bytes=data.get("target_bytes"),
            placement=Placement.from_dict(data["placement"]),
            original_batch_size=int(data.get("original_batch_size", 0)),
            original_input_shape=tuple(data.get("original_input_shape", (0, 0, 0))),
            calibration_source=data.get("calibration", ""),
            calibration_warning=data.get("calibration_warning"),
            workers=int(data.get("workers", 1)),
            lever=data.get("lever"),
            file_backed_calibrated_bytes=(data.get("runtime_file_backed") or {}).get("calibrated_bytes"),
            file_backed_measured_bytes=(data.get("runtime_file_backed") or {}).get("measured_bytes"),
            expected_range=_range_from_dict(data.get("expected_range")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "batch_size_per_worker": self.config.training.batch_size // self.workers,
            "peak_bytes": self.peak_bytes,
            "peak_gib": gib(self.peak_bytes),
            "target_bytes": self.target_bytes,
            "target_gib": gib(self.target_bytes) if self.target_bytes is not None else None,
            "batch_size": self.config.training.batch_size,
            "input_shape": list(self.config.data.input_shape),
            "original_batch_size": self.original_batch_size,
            "original_input_shape": list(self.original_input_shape),
            "precision": self.config.runtime.precision,
            "recompute": self.config.model.recompute,
            "breakdown": {key: {"bytes": value, "gib": gib(value)} for key, value in self.breakdown.items()},
            "placement": self.placement.to_dict(),
            "calibration": self.calibration_source,
            "calibration_warning": self.calibration_warning,
            "lever": self.lever,
            "runtime_file_backed": {
                "calibrated_bytes": self.file_backed_calibrated_bytes,
                "measured_bytes": self.file_backed_measured_bytes,
            },
            "expected_range": self._range_dict(),
        }

    def _range_dict(self) -> dict[str, Any] | None:
        bounds = self.range_bytes()
        if bounds is None or self.expected_range is None:
            return None
        return {
            **self.expected_range,
            "low_bytes": bounds[0],
            "low_gib": gib(bounds[0]),
            "high_bytes": bounds[1],
            "high_gib": gib(bounds[1]),
        }

    def range_statement(self) -> str | None:
        """ "runs of this kind end 0.4-5.1 % below it ..." for a person, or None."""
        if not self.expected_range:
            return None
        low, high = self.expected_range["below"]
        coverage = self.expected_range["coverage"]
        lowest, highest = self.range_bytes()
        growth = self.expected_range.get("long_run_growth")
        if long_below := self.expected_range.get("long_below"):
            # Measured on runs past the climb: what a user's run ends at; short runs told apart.
            steps = self.expected_range.get("long_steps")
            ended = (
                f"its {self.expected_range['long_runs']} long calibration runs"
                + (f" ({steps} training steps, past the climb)" if steps else "")
                + f" {ended_span(*long_below)}; its {self.expected_range['runs']} short ones (4 steps) "
                f"{ended_span(low, high, 'it').removeprefix('ended ')}"
                + (f", as it adds {growth:.1%} fitted on the long runs" if growth else "")
            )
        else:
            ended = f"its {self.expected_range['runs']} calibration runs {ended_span(low, high)}" + (
                f" (short runs: it adds {growth:.0%} for what a long run climbs past them)" if growth else ""
            )
        return (
            f"the plan is the upper envelope of this kind of job's runs ({self.expected_range['kind']}): "
            + ended
            + f", and a run may end at most {coverage:.0%} above it "
            f"({format_bytes(lowest)} to {format_bytes(highest)})"
        )


def _range_from_dict(data: dict[str, Any] | None) -> dict[str, Any] | None:
    if not data:
        return None
    keys = (
        "kind",
        "below",
        "runs",
        "coverage",
        "cost_bound",
        "long_run_growth",
        "long_below",
        "long_runs",
        "long_steps",
    )
    return {key: data[key] for key in keys if key in data}


def plan_job(
    config: Config,
    host: HostFacts | None,
    calibration: Calibration | None = None,
    *,
    to_run_here: bool = True,
    workers: int | None = None,
) -> JobPlan:
    """Size ``config`` to footprint.target (if any), predict its peak and decide its NUMA placement.

    ``to_run_here``: the job is to run on ``host`` (run, train, preflight), so a target the host cannot give
    does not fit (exit 3) and the targets a refusal suggests stop at what the host leaves the job. False for
    ``bigmem-train plan``, which may plan a job for a larger host and says whether it fits this one.
    ``workers``: the multi-worker job's worker count where it is known before its TF_CONFIG exists (a Slurm
    job's nodes); None: TF_CONFIG's count (:func:`planned_workers`).
    """
    calibration = calibration or constants.load_calibration()
    table = layers.layer_table(config)
    target = resolve_target(config, host)
    bound = host if to_run_here else None
    if target is not None and bound is not None:
        _refuse_target_beyond_host(config, bound, target)
    # A multi-worker job is planned per host: each worker holds a whole replica and computes
    # batch_size / workers samples; the target is per host too.
    workers = planned_workers(config) if workers is None else workers
    per_host = with_job_size(config, per_worker_batch_size(config, workers), tuple(config.data.input_shape))
    sized, lever = config, None
    limit = target if target is not None else _host_limit(config, host)
    if config.footprint.levers == "auto" and limit is not None:
        lever = _lever_for(per_host, sizing_limit(limit) if target is not None else limit, calibration, host)
        if lever is not None:
            sized = with_job_size(lever.config, config.training.batch_size, tuple(config.data.input_shape))
            table = layers.layer_table(sized)
    if target is not None and lever is None:
        batch, shape = size_to_target(per_host, sizing_limit(target), table, calibration)
        sized = with_job_size(config, batch * workers, shape)
    breakdown = breakdown_for(
        sized, table, calibration, sized.training.batch_size // workers, tuple(sized.data.input_shape)
    )
    if workers > 1:
        # The all-reduce packs the gradients into buffers of their size once more.
        breakdown["allreduce_buffers"] = breakdown["gradients"]
    peak = sum(breakdown.values())
    if target is not None and peak > target * (1 + config.footprint.tolerance):
        # Sizing fell back to the smallest job it may make, and even that misses the target: a run
        # would train and then fail its footprint check, so the target is refused before any work.
        shape = "x".join(map(str, sized.data.input_shape))
        usable = _host_limit(config, bound)
        if usable is not None and peak > usable:
            # Suggesting "at least" that would suggest a target the host cannot hold.
            raise DoesNotFit(
                f"footprint.target {format_bytes(target)} is below the smallest job this config can be sized "
                f"to (resize: {config.footprint.resize}): input {shape}, batch {sized.training.batch_size} is "
                f"predicted at {format_bytes(peak)}, more than the {format_bytes(usable)} this host leaves it; "
                f"let more change (footprint.resize, model.recompute, runtime.precision)"
            )
        raise BadInput(
            f"footprint.target {format_bytes(target)} is below the smallest job this config can be sized to "
            f"(resize: {config.footprint.resize}): input {shape}, batch {sized.training.batch_size} is predicted "
            f"at {format_bytes(peak)}; set a target of at least that"
        )
    if target is not None and lever is None and _short_of(peak, target, config):
        # The job sizing may make comes closest from below and still misses the target by more than the
        # tolerance (a batch step of the study's tile is ~10 GiB): the run would train and then fail its
        # footprint check, so this is refused too, naming the jobs on either side of the target. (A job a
        # lever kept is not resized: there the target is the ceiling it must stay under.)
        raise BadInput(_unreachable_target(config, sized, table, calibration, workers, peak, target, bound))
    if host is not None:
        placement = decide_placement(peak, host, config.runtime.numa_policy, config.footprint.safety_margin)
    else:
        placement = Placement("none", [], [], "no host facts")
    return JobPlan(
        sized,
        peak,
        breakdown,
        target,
        placement,
        config.training.batch_size,
        tuple(config.data.input_shape),
        calibration.source,
        calibration.warning(config, host),
        workers,
        lever.change if lever else None,
        calibration.file_backed_bytes,
        expected_range=calibration.expected_range(sized),
    )


def sizing_limit(target: int) -> int:
    """The plan a job sized to ``target`` may have: a run may end up to PLAN_COVERAGE above its plan, and
    a job sized to a target must not pass it."""
    return int(target / (1 + PLAN_COVERAGE))


def _short_of(peak: int, target: int, config: Config) -> bool:
    """Whether a job predicted at ``peak`` falls short of ``target`` by more than footprint.tolerance."""
    return peak < target * (1 - config.footprint.tolerance)


def _refuse_target_beyond_host(config: Config, host: HostFacts, target: int) -> None:
    """Raise :class:`DoesNotFit` for a target no job sized to it can fit on ``host``: even a job at the
    low end of the tolerance (target less footprint.tolerance) is above the memory the host leaves it."""
    usable = _host_limit(config, host)
    if target * (1 - config.footprint.tolerance) <= usable:
        return
    raise DoesNotFit(
        f"footprint.target {format_bytes(target)} does not fit this host: {format_bytes(usable)} usable "
        f"({allowance(config, host).why}); set a target of at most {format_bytes(usable)}"
    )


def _unreachable_target(config, sized, table, calibration, workers, peak, target, host=None) -> str:
    """The one-line refusal of a target that sizing cannot come within the tolerance of; the targets it
    suggests stop at what the host leaves the job."""
    shape = tuple(sized.data.input_shape)
    batch = sized.training.batch_size // workers
    above = sum(breakdown_for(sized, table, calibration, batch + 1, shape).values())
    tolerance = config.footprint.tolerance

    def in_gib(value: float) -> str:  # from the bytes, not from gib()'s 3 decimals (rounded twice)
        return f"{value / 2**30:.2f}"

    highest = peak / (1 - tolerance)
    usable = _host_limit(config, host)
    if usable is not None:
        highest = min(highest, usable)
    return (
        f"footprint.target {format_bytes(target)} cannot be reached within footprint.tolerance "
        f"{tolerance:.0%} (resize: {config.footprint.resize}): input {'x'.join(map(str, shape))} is predicted "
        f"at {in_gib(peak)} GiB with batch {batch} and {in_gib(above)} GiB with batch {batch + 1}"
        f"{' per worker' if workers > 1 else ''}; set a target between {in_gib(peak / (1 + tolerance))} and "
        f"{in_gib(highest)} GiB, or let more change (footprint.resize, model.recompute)"
    )


class Allowance(NamedTuple):
    """What a job may take (``bytes``), why in words, and whether a cgroup limit decided it."""

    bytes: int
    why: str
    by_cgroup: bool


def allowance(config: Config, host: HostFacts) -> Allowance:
    """What a job may take on ``host``, and why, in words: the host's available memory less
    ``footprint.safety_margin`` (room for the OS and everything else on the host); under a cgroup limit (a
    scheduler's ``--mem``, ``docker run --memory``: the job's own allowance, with nothing else in it) at most
    what keeps a run that ends PLAN_COVERAGE above its plan under the memory guard's ``guard.threshold`` of
    the limit, whichever is smaller. ``bigmem-train submit`` asks for the inverse (ops.scheduler.mem_request_mib),
    so a job given its request always fits it."""
    margin = config.footprint.safety_margin
    available = host.memory_available_bytes
    room = int(available * (1.0 - margin))
    limit = host.cgroup_limit_bytes
    if limit:
        held = int(limit * config.guard.threshold / (1 + PLAN_COVERAGE))
        if held <= room:
            return Allowance(
                held,
                f"the cgroup v{host.cgroup_version} memory limit {format_bytes(limit)}, less what keeps a run "
                f"{PLAN_COVERAGE:.0%} above its plan under the memory guard's {config.guard.threshold:.0%} of it",
                True,
            )
    return Allowance(
        room,
        f"the host's available memory (MemAvailable) {format_bytes(available)} less the {margin:.0%} safety margin",
        False,
    )


def _host_limit(config: Config, host: HostFacts | None) -> int | None:
    """What the job may take on ``host`` (:func:`allowance`); None without host facts."""
    return None if host is None else allowance(config, host).bytes


def _lever_for(
    per_host: Config, limit: int, calibration: Calibration, host: HostFacts | None
) -> Lever | None:
    """The cheapest lever that keeps the job's batch and shape and brings it under ``limit``; None when
    the job fits as it is or no such lever does."""
    return cheapest_keeping_job(levers_to_fit(per_host, limit, calibration, host.cpu_flags if host else None))
