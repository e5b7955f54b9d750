"""NUMA placement: bind a job to one node (memory and cores) when it fits there, else interleave."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bigmem_train.host import HostFacts
from bigmem_train.sizes import format_bytes


@dataclass
class Placement:
    """Where the job's memory and threads go. ``policy``: bind (one node, its cores), interleave, none."""

    policy: Literal["bind", "interleave", "none"]
    nodes: list[int]
    cpus: list[int]
    reason: str
    all_memory_nodes: bool = False

    def numactl_args(self) -> list[str]:
        """The numactl prefix to re-execute the job under ([] for none)."""
        if self.policy == "bind":
            joined = ",".join(map(str, self.nodes))
            return ["numactl", f"--membind={joined}", f"--cpunodebind={joined}"]
        if self.policy == "interleave":
            nodes = "all" if self.all_memory_nodes else ",".join(map(str, self.nodes))
            return ["numactl", f"--interleave={nodes}"]
        return []

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "nodes": self.nodes,
            "cpus": self.cpus,
            "reason": self.reason,
            "all_memory_nodes": self.all_memory_nodes,
            "numactl": self.numactl_args(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Placement:
        return cls(
            data["policy"],
            list(data["nodes"]),
            list(data["cpus"]),
            data["reason"],
            bool(data.get("all_memory_nodes", False)),
        )


def decide_placement(peak_bytes: int, host: HostFacts, numa_policy: str, safety_margin: float) -> Placement:
    """Bind to one node with CPUs when the job fits its available memory with the margin, else interleave.

    Memory-only nodes (no CPUs: CXL expanders, persistent memory) are never bound to; they join an
    interleave only when the nodes with CPUs together cannot hold the job.
    """
    nodes = [node for node in host.numa_nodes if node.memory_total_bytes > 0]
    usable = set(host.usable_cpus)
    if len(nodes) <= 1:
        return Placement(
            "none", [node.node_id for node in nodes], sorted(usable), "one NUMA node: nothing to place"
        )
    if numa_policy == "none":
        return Placement("none", [], sorted(usable), "numa_policy is none: the kernel's default placement")
    keep = 1.0 - safety_margin

    def node_cpus(node) -> list[int]:
        return sorted(set(node.cpus) & usable) if usable else list(node.cpus)

    with_cpus = [node for node in nodes if node_cpus(node)]
    if numa_policy in {"auto", "bind"}:
        fitting = [node for node in with_cpus if peak_bytes <= node.memory_available_bytes * keep]
        if fitting:
            node = max(fitting, key=lambda n: (n.memory_available_bytes, -n.node_id))
            return Placement(
                "bind",
                [node.node_id],
                node_cpus(node),
                f"fits node {node.node_id}: {format_bytes(peak_bytes)} <= {keep:.0%} of its available "
                f"{format_bytes(node.memory_available_bytes)}; memory and cores bound to it",
            )
    prefix = "bind requested but no node with CPUs holds the job; " if numa_policy == "bind" else ""
    cpu_memory = sum(node.memory_available_bytes for node in with_cpus)
    cpus = sorted({cpu for node in with_cpus for cpu in node_cpus(node)})
    if peak_bytes <= cpu_memory * keep or len(with_cpus) == len(nodes):
        chosen = with_cpus
        reason = (
            f"{prefix}larger than any one node; interleaved over the {len(chosen)} nodes with CPUs "
            f"({format_bytes(cpu_memory)} available)"
        )
    else:
        chosen = nodes
        reason = (
            f"{prefix}larger than the nodes with CPUs hold ({format_bytes(cpu_memory)} available); "
            f"interleaved over all {len(nodes)} nodes incl. memory-only ones"
        )
    return Placement(
        "interleave",
        [node.node_id for node in chosen],
        cpus,
        reason,
        all_memory_nodes=len(chosen) == len(nodes),
    )
