"""Preflight: read the host and refuse, in seconds, a plan the planner expects to be killed.

Available memory is the smaller of MemAvailable (which already leaves out static hugepages: TensorFlow's
allocator cannot use them) and the cgroup limit; ``footprint.safety_margin`` of it is kept free. Swap is
reported but not counted: a training step that pages is a step that never ends.
"""

from __future__ import annotations

import json
from typing import Any

from .config import Config
from .errors import DoesNotFit
from .host import HostFacts, read_host_facts
from .planner import JobPlan, largest_batch, largest_shape, layer_table, load_calibration, plan_job
from .sizes import format_bytes, gib


def usable_bytes(plan: JobPlan, host: HostFacts) -> int:
    """What the job may take: available memory (capped by the cgroup limit) less the safety margin; when
    the plan binds to one node, that node's available memory less the margin."""
    margin = plan.config.footprint.safety_margin
    available = host.effective_memory_bytes
    if plan.placement.policy == "bind":
        nodes = {node.node_id: node for node in host.numa_nodes}
        node_available = sum(nodes[n].memory_available_bytes for n in plan.placement.nodes if n in nodes)
        if node_available:
            available = min(available, node_available)
    return int(available * (1.0 - margin))


def largest_fitting(plan: JobPlan, limit_bytes: int) -> tuple[int, tuple[int, int, int] | None]:
    """(largest batch at the plan's shape, largest shape at batch 1) within ``limit_bytes``."""
    config = plan.config
    table = layer_table(config)
    calibration = load_calibration()
    batch = largest_batch(config, table, calibration, tuple(config.data.input_shape), limit_bytes)
    shape = largest_shape(config, table, calibration, 1, limit_bytes, ceiling=tuple(config.data.input_shape))
    return batch, shape


def check_fits(plan: JobPlan, host: HostFacts) -> None:
    """Raise :class:`DoesNotFit` when the plan's predicted peak exceeds what the host leaves it."""
    usable = usable_bytes(plan, host)
    if plan.peak_bytes <= usable:
        return
    margin = plan.config.footprint.safety_margin
    parts = [
        f"predicted peak {format_bytes(plan.peak_bytes)} exceeds {format_bytes(usable)} usable "
        f"({host.limit_in_force} {format_bytes(host.effective_memory_bytes)} less the {margin:.0%} safety margin)",
    ]
    if host.cgroup_limit_bytes:
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
    parts.append("lower training.batch_size or data.input_shape, or set footprint.target")
    raise DoesNotFit("; ".join(parts))


def host_summary(host: HostFacts) -> dict[str, Any]:
    """The facts preflight reports, in bytes and GiB."""
    def both(value: int | None) -> dict[str, Any] | None:
        return None if value is None else {"bytes": value, "gib": gib(value)}

    return {
        "hostname": host.hostname,
        "memory_total": both(host.memory_total_bytes),
        "memory_available": both(host.memory_available_bytes),
        "cgroup_version": host.cgroup_version,
        "cgroup_limit": both(host.cgroup_limit_bytes),
        "cgroup_usage": both(host.cgroup_usage_bytes),
        "limit_total": both(host.limit_total_bytes),
        "limit_in_force": host.limit_in_force,
        "swap_total": both(host.swap_total_bytes),
        "swap_free": both(host.swap_free_bytes),
        "thp_enabled": host.thp_enabled,
        "thp_defrag": host.thp_defrag,
        "static_hugepages": both(host.static_hugepages_bytes),
        "logical_cpus": host.logical_cpus,
        "physical_cores": host.physical_cores,
        "numa_nodes": [
            {"node": node.node_id, "cpus": len(node.cpus), "memory_total": both(node.memory_total_bytes),
             "memory_available": both(node.memory_available_bytes),
             "static_hugepages": both(node.static_hugepages_bytes)}
            for node in host.numa_nodes
        ],
    }


def _format_host(host: HostFacts) -> str:
    lines = [
        f"host: {host.hostname}, {host.logical_cpus} logical CPUs, {host.physical_cores} physical cores",
        f"  memory total      {format_bytes(host.memory_total_bytes)}",
        f"  memory available  {format_bytes(host.memory_available_bytes)}",
        "  cgroup limit      " + (f"{format_bytes(host.cgroup_limit_bytes)} (v{host.cgroup_version})"
                                  if host.cgroup_limit_bytes else
                                  f"none (cgroup v{host.cgroup_version})" if host.cgroup_version else "none"),
        f"  swap              {format_bytes(host.swap_total_bytes)} total, {format_bytes(host.swap_free_bytes)} free",
        f"  transparent hugepages: enabled [{host.thp_enabled}], defrag [{host.thp_defrag}]",
        f"  static hugepages  {format_bytes(host.static_hugepages_bytes)} (not usable by TensorFlow)",
        f"  NUMA nodes        {len(host.numa_nodes)}",
    ]
    for node in host.numa_nodes:
        kind = f"{len(node.cpus)} CPUs" if node.cpus else "no CPUs (memory only)"
        lines.append(f"    node {node.node_id}: {kind}, total {format_bytes(node.memory_total_bytes)}, "
                     f"available {format_bytes(node.memory_available_bytes)}")
    return "\n".join(lines)


def preflight_command(config: Config, as_json: bool) -> int:
    """``bigmem-train preflight``: print host facts and the fit decision; exit 3 when it does not fit."""
    host = read_host_facts()
    plan = plan_job(config, host)
    usable = usable_bytes(plan, host)
    fits = plan.peak_bytes <= usable
    if as_json:
        print(json.dumps({"host": host_summary(host), "plan": plan.to_dict(),
                          "usable": {"bytes": usable, "gib": gib(usable)}, "fits": fits}, indent=2))
    else:
        print(_format_host(host))
        print(f"plan: peak {format_bytes(plan.peak_bytes)}, usable {format_bytes(usable)} "
              f"({host.limit_in_force} {format_bytes(host.effective_memory_bytes)} less the "
              f"{config.footprint.safety_margin:.0%} safety margin); placement {plan.placement.policy}")
    check_fits(plan, host)
    if not as_json:
        print("fits: yes")
    return 0
