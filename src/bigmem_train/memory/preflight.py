"""Preflight: read the host and refuse, in seconds, a plan the planner expects to be killed.

What a job may take is MemAvailable (which already leaves out static hugepages: TensorFlow's allocator
cannot use them) less ``footprint.safety_margin``, and under a cgroup limit at most what keeps a run at the
edge of its plan's promise under the memory guard's share of the limit (``plan.allowance``). Swap is
reported but not counted: a training step that pages is a step that never ends.
"""

from __future__ import annotations

from bigmem_train.errors import DoesNotFit
from bigmem_train.host import HostFacts
from bigmem_train.memory import constants, layers
from bigmem_train.memory.levers import levers_to_fit
from bigmem_train.memory.plan import JobPlan, allowance
from bigmem_train.memory.sizing import largest_batch, largest_shape
from bigmem_train.sizes import format_bytes


def usable_bytes(plan: JobPlan, host: HostFacts) -> int:
    """What the job may take (:func:`~bigmem_train.memory.plan.allowance`: available memory less the safety
    margin, under a cgroup limit what keeps the plan's promise under the memory guard); when the plan binds
    to one node, at most that node's available memory less the margin."""
    usable = allowance(plan.config, host).bytes
    if plan.placement.policy == "bind":
        nodes = {node.node_id: node for node in host.numa_nodes}
        node_available = sum(nodes[n].memory_available_bytes for n in plan.placement.nodes if n in nodes)
        if node_available:
            usable = min(usable, int(node_available * (1.0 - plan.config.footprint.safety_margin)))
    return usable


def largest_fitting(plan: JobPlan, limit_bytes: int) -> tuple[int, tuple[int, int, int] | None]:
    """(largest batch at the plan's shape, largest shape at batch 1) within ``limit_bytes``."""
    config = plan.config
    table = layers.layer_table(config)
    calibration = constants.load_calibration()
    batch = largest_batch(config, table, calibration, tuple(config.data.input_shape), limit_bytes)
    shape = largest_shape(config, table, calibration, 1, limit_bytes, ceiling=tuple(config.data.input_shape))
    return batch, shape


def check_fits(plan: JobPlan, host: HostFacts) -> None:
    """Raise :class:`DoesNotFit` when the plan's predicted peak exceeds what the host leaves it."""
    usable = usable_bytes(plan, host)
    if plan.peak_bytes <= usable:
        return
    allowed = allowance(plan.config, host)
    parts = [
        f"predicted peak {format_bytes(plan.peak_bytes)} exceeds {format_bytes(usable)} usable ({allowed.why})"
    ]
    if host.cgroup_limit_bytes and not allowed.by_cgroup:
        parts.append(f"cgroup v{host.cgroup_version} limit {format_bytes(host.cgroup_limit_bytes)}")
    if host.static_hugepages_bytes:
        parts.append(f"{format_bytes(host.static_hugepages_bytes)} held by static hugepages")
    batch, shape = largest_fitting(plan, usable)
    config = plan.config
    shape_text = "x".join(map(str, config.data.input_shape))
    if batch >= 1:
        parts.append(f"largest batch that fits at {shape_text}: {batch}")
    else:
        parts.append(f"not even batch 1 fits at {shape_text}")
    if shape:
        parts.append(f"largest input shape that fits at batch 1: {'x'.join(map(str, shape))}")
    levers = levers_to_fit(config, usable, constants.load_calibration(), host.cpu_flags)
    if levers:
        parts.append(
            "what would make it fit, cheapest first: "
            + " | ".join(f"({number}) {lever.describe()}" for number, lever in enumerate(levers, 1))
        )
    parts.append(
        "set one of these, or footprint.target (footprint.levers: auto applies the first that keeps "
        "the batch and shape)"
    )
    raise DoesNotFit("; ".join(parts))
