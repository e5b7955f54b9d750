"""What the CLI prints for a person: the plan's breakdown, the host's facts (and their JSON form)."""

from __future__ import annotations

from typing import Any

from bigmem_train.host import HostFacts
from bigmem_train.memory.plan import JobPlan
from bigmem_train.sizes import format_bytes, gib


def format_plan(plan: JobPlan) -> str:
    """The human-readable plan: breakdown in bytes and GiB, the chosen job, the placement."""
    config = plan.config
    lines = [
        f"job: input {'x'.join(map(str, config.data.input_shape))} x {config.num_channels} channel(s), "
        f"batch {config.training.batch_size}, {config.model.base_filters} base filters, depth {config.model.depth}, "
        f"{config.runtime.precision}{', recompute' if config.model.recompute else ''}",
    ]
    if plan.target_bytes is not None:
        lines.append(
            f"target: {format_bytes(plan.target_bytes)} (resize: {config.footprint.resize}; was input "
            f"{'x'.join(map(str, plan.original_input_shape))}, batch {plan.original_batch_size})"
        )
    if plan.lever:
        lines.append(
            f"lever: {plan.lever} (footprint.levers: auto; the job as configured missed "
            f"{'the target' if plan.target_bytes is not None else 'this host'})"
        )
    if plan.workers > 1:
        lines.append(
            f"multi-worker: {plan.workers} hosts, each one replica with batch "
            f"{config.training.batch_size // plan.workers}; the figures below are per host"
        )
    lines.append("predicted peak memory:")
    width = max(len(key) for key in plan.breakdown)
    for key, value in plan.breakdown.items():
        lines.append(f"  {key:<{width}}  {format_bytes(value)}")
    lines.append(f"  {'total':<{width}}  {format_bytes(plan.peak_bytes)}")
    if statement := plan.range_statement():
        lines.append(f"  {statement}")
    voxels = config.training.batch_size // plan.workers * config.voxels_per_sample
    lines.append(
        f"per input voxel: {plan.breakdown['activations'] / voxels:.0f} B for the activations kept for "
        "backward, "
        f"{plan.peak_bytes / voxels:.0f} B in all"
    )
    lines.append(f"placement: {plan.placement.policy} ({plan.placement.reason})")
    if plan.placement.numactl_args():
        lines.append(f"  {' '.join(plan.placement.numactl_args())}")
    lines.append(f"constants: {plan.calibration_source}")
    if plan.calibration_warning:
        lines.append(f"  warning: {plan.calibration_warning}")
    return "\n".join(lines)


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
            {
                "node": node.node_id,
                "cpus": len(node.cpus),
                "memory_total": both(node.memory_total_bytes),
                "memory_available": both(node.memory_available_bytes),
                "static_hugepages": both(node.static_hugepages_bytes),
            }
            for node in host.numa_nodes
        ],
    }


def format_host(host: HostFacts) -> str:
    lines = [
        f"host: {host.hostname}, {host.logical_cpus} logical CPUs, {host.physical_cores} physical cores",
        f"  memory total      {format_bytes(host.memory_total_bytes)}",
        f"  memory available  {format_bytes(host.memory_available_bytes)}",
        "  cgroup limit      "
        + (
            f"{format_bytes(host.cgroup_limit_bytes)} (v{host.cgroup_version})"
            if host.cgroup_limit_bytes
            else f"none (cgroup v{host.cgroup_version})"
            if host.cgroup_version
            else "none"
        ),
        f"  swap              {format_bytes(host.swap_total_bytes)} total, {format_bytes(host.swap_free_bytes)} free",
        f"  transparent hugepages: enabled [{host.thp_enabled}], defrag [{host.thp_defrag}]",
        f"  static hugepages  {format_bytes(host.static_hugepages_bytes)} (not usable by TensorFlow)",
        f"  NUMA nodes        {len(host.numa_nodes)}",
    ]
    for node in host.numa_nodes:
        kind = f"{len(node.cpus)} CPUs" if node.cpus else "no CPUs (memory only)"
        lines.append(
            f"    node {node.node_id}: {kind}, total {format_bytes(node.memory_total_bytes)}, "
            f"available {format_bytes(node.memory_available_bytes)}"
        )
    return "\n".join(lines)
