"""Facts about the host this job runs on, read from /proc and /sys (no TensorFlow needed).

Every reader takes a ``root`` so tests can point it at a recorded sysfs/procfs layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bigmem_train.errors import BadInput


@dataclass
class NumaNode:
    node_id: int
    memory_total_bytes: int
    memory_free_bytes: int
    cpus: list[int]
    hugepages_2m: int = 0
    hugepages_1g: int = 0
    # Free memory plus page cache the kernel can drop (file pages, not shared memory): what a job may take here.
    memory_available_bytes: int = 0

    @property
    def has_cpus(self) -> bool:
        """False for memory-only nodes (CXL expanders, persistent memory as system RAM)."""
        return bool(self.cpus)

    @property
    def static_hugepages_bytes(self) -> int:
        return self.hugepages_2m * 2 * 1024**2 + self.hugepages_1g * 1024**3


@dataclass
class HostFacts:
    hostname: str
    memory_total_bytes: int
    memory_available_bytes: int
    swap_total_bytes: int
    cgroup_limit_bytes: int | None
    cgroup_version: int | None
    logical_cpus: int
    physical_cores: int
    usable_cpus: list[int]
    numa_nodes: list[NumaNode] = field(default_factory=list)
    thp_enabled: str = "unknown"
    thp_defrag: str = "unknown"
    hugepages_total: int = 0
    hugepage_size_bytes: int = 0
    cpu_flags: list[str] = field(default_factory=list)
    kernel_cmdline: str = ""
    # Bytes held by static hugetlbfs pages of every size (meminfo "Hugetlb"); TensorFlow cannot use them.
    hugetlb_bytes: int = 0
    swap_free_bytes: int = 0
    # Memory charged to this process's cgroup now (None without a cgroup memory controller).
    cgroup_usage_bytes: int | None = None
    # /proc/cpuinfo's "model name" ("" where it has none): oneDNN picks kernels, blockings and buffers by
    # the CPU, so the planner's constants are fitted per CPU (see Calibration.cpu_mismatch).
    cpu_model: str = ""

    @property
    def cpu_isa(self) -> str:
        return cpu_isa(self.cpu_flags)

    @property
    def effective_memory_bytes(self) -> int:
        """Memory this process may use: the smaller of available memory and what the cgroup limit leaves.

        MemAvailable already excludes static hugepages; the cgroup limit counts page cache, which the
        kernel reclaims before it kills, so only the limit itself (not limit - usage) caps a job.
        """
        limits = [self.memory_available_bytes]
        if self.cgroup_limit_bytes:
            limits.append(self.cgroup_limit_bytes)
        return min(limits)

    @property
    def limit_in_force(self) -> str:
        """Which limit ``effective_memory_bytes`` is: the cgroup's (what the kernel enforces on the charge)
        or the host's available memory."""
        if self.cgroup_limit_bytes and self.cgroup_limit_bytes <= self.memory_available_bytes:
            return f"the cgroup v{self.cgroup_version} memory limit"
        return "the host's available memory (MemAvailable)"

    @property
    def limit_total_bytes(self) -> int:
        """Total memory a job may see: physical total less static hugepages, capped by the cgroup limit.

        A share of the host ("80%") refers to this.
        """
        total = self.memory_total_bytes - self.static_hugepages_bytes
        if self.cgroup_limit_bytes:
            return min(total, self.cgroup_limit_bytes)
        return total

    @property
    def static_hugepages_bytes(self) -> int:
        return max(self.hugetlb_bytes, self.hugepages_total * self.hugepage_size_bytes)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["effective_memory_bytes"] = self.effective_memory_bytes
        data["static_hugepages_bytes"] = self.static_hugepages_bytes
        data["limit_total_bytes"] = self.limit_total_bytes
        data["limit_in_force"] = self.limit_in_force
        return data


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text()
    except OSError:
        return default


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo (or a node's meminfo) -> {key: bytes} (HugePages_* stay counts)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"^(?:Node \d+ )?([A-Za-z_()0-9]+):\s+(\d+)(?:\s+kB)?", line)
        if match:
            key, number = match.group(1), int(match.group(2))
            values[key] = number * 1024 if line.rstrip().endswith("kB") else number
    return values


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-")
            cpus.extend(range(int(low), int(high) + 1))
        else:
            cpus.append(int(part))
    return cpus


def _bracketed(text: str) -> str:
    match = re.search(r"\[(\w+)\]", text)
    return match.group(1) if match else (text.strip() or "unknown")


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # v1 reports "no limit" as a huge page-aligned number.
    return None if value >= 2**60 else value


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in the v1 memory hierarchy."""
    v2_path, v1_path = None, None
    for line in _read(root / "proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "memory" in parts[1].split(","):
            v1_path = parts[2]
    return v2_path, v1_path


def _candidates(base: Path, cgroup_path: str | None) -> list[Path]:
    """The process's cgroup folder and its ancestors up to the mount (inside a container the path
    from /proc/self/cgroup may not exist under the namespaced mount, so the mount itself comes last)."""
    folders: list[Path] = []
    if cgroup_path:
        folder = base / cgroup_path.strip("/")
        while True:
            if folder.is_dir() and folder not in folders:
                folders.append(folder)
            if folder == base:
                break
            folder = folder.parent
    if base not in folders:
        folders.append(base)
    return folders


@dataclass(frozen=True)
class MemoryCgroup:
    """The memory cgroup that charges this process, as seen from here (host or container).

    ``path`` is the cgroup as /proc/self/cgroup names it; ``folder`` is where its files are under the
    mount (inside a container without its own cgroup namespace the mount itself is the container's
    cgroup, so the folder can be the mount). Every reader returns None when its file is missing.
    Cheap reads (``usage_bytes``) are single counters; ``stat`` and ``limit_bytes`` read more.
    """

    version: int
    path: str
    folder: Path
    base: Path

    def _read_int(self, name: str) -> int | None:
        return _int_or_none(_read(self.folder / name))

    def usage_bytes(self) -> int | None:
        """Memory charged now (v2 ``memory.current``, v1 ``memory.usage_in_bytes``), page cache included."""
        return self._read_int("memory.current" if self.version == 2 else "memory.usage_in_bytes")

    def peak_bytes(self) -> int | None:
        """The kernel's high-water mark of the charge since the cgroup was made (v2 ``memory.peak``, v1
        ``memory.max_usage_in_bytes``)."""
        return self._read_int("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")

    def stat(self) -> dict[str, int]:
        """``memory.stat`` as {key: value} (v1's ``total_*`` keys fold in the descendants)."""
        values: dict[str, int] = {}
        for line in _read(self.folder / "memory.stat").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                values[parts[0]] = int(parts[1])
        return values

    def inactive_file_bytes(self) -> int:
        """Page cache on the inactive list: reclaimed first, before the OOM killer is called."""
        stat = self.stat()
        return stat.get(
            "inactive_file" if self.version == 2 else "total_inactive_file", stat.get("inactive_file", 0)
        )

    def limit_bytes(self) -> int | None:
        """The limit in force: v2 the smallest ``memory.max`` of the cgroup and its ancestors; v1
        ``memory.limit_in_bytes`` capped by ``hierarchical_memory_limit`` (which folds in the ancestors)."""
        if self.version == 2:
            limits = []
            folder = self.folder
            while True:
                limit = _int_or_none(_read(folder / "memory.max"))
                if limit is not None:
                    limits.append(limit)
                if folder == self.base or self.base not in folder.parents:
                    break
                folder = folder.parent
            return min(limits) if limits else None
        limit = self._read_int("memory.limit_in_bytes")
        hierarchical = self.stat().get("hierarchical_memory_limit")
        if hierarchical is not None and hierarchical < 2**60:
            limit = hierarchical if limit is None else min(limit, hierarchical)
        return limit

    @property
    def oom_counter_file(self) -> Path:
        """The file whose ``oom_kill`` line counts the OOM killer's kills in this cgroup."""
        return self.folder / ("memory.events" if self.version == 2 else "memory.oom_control")

    def oom_kills(self) -> int | None:
        """Processes of this cgroup the OOM killer has killed (v2 ``memory.events`` oom_kill, v1
        ``memory.oom_control`` oom_kill); None when the kernel does not count them here."""
        return oom_kill_count(_read(self.oom_counter_file))

    def describe(self) -> str:
        return f"cgroup v{self.version} {self.path or '/'}"


def oom_kill_count(text: str) -> int | None:
    """The ``oom_kill N`` line of memory.events, memory.oom_control or /proc/vmstat."""
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def host_oom_kills(root: Path = Path("/")) -> int | None:
    """Kills by the OOM killer on this host since boot, any cgroup (/proc/vmstat oom_kill)."""
    return oom_kill_count(_read(root / "proc/vmstat"))


def find_memory_cgroup(root: Path = Path("/")) -> MemoryCgroup | None:
    """This process's memory cgroup (v2 when the unified hierarchy has the memory controller, else v1);
    None without one. In a hybrid layout (v2 mounted at ``unified/`` without the memory controller) v1
    is used."""
    v2_path, v1_path = _cgroup_paths(root)
    base = root / "sys/fs/cgroup"
    if (base / "cgroup.controllers").exists():
        for folder in _candidates(base, v2_path):
            if (folder / "memory.current").exists():
                return MemoryCgroup(2, v2_path or "/", folder, base)
        return None
    memory_base = base / "memory"
    if memory_base.is_dir():
        for folder in _candidates(memory_base, v1_path):
            if (folder / "memory.limit_in_bytes").exists():
                return MemoryCgroup(1, v1_path or "/", folder, memory_base)
    return None


def read_cgroup_memory(root: Path = Path("/")) -> tuple[int | None, int | None, int | None]:
    """(limit, version, usage) of this process's memory cgroup; limit None when unlimited.

    v2: the smallest ``memory.max`` of the cgroup and its ancestors; usage from ``memory.current``.
    v1: ``hierarchical_memory_limit`` from ``memory.stat`` (which folds in the ancestors) or
    ``memory.limit_in_bytes``; usage from ``memory.usage_in_bytes``.
    """
    v2_path, _v1_path = _cgroup_paths(root)
    base = root / "sys/fs/cgroup"
    if (base / "cgroup.controllers").exists():
        cgroup = find_memory_cgroup(root)
        if cgroup is None:
            # The root cgroup has no memory files of its own; limits may still sit on the way down.
            cgroup = MemoryCgroup(2, v2_path or "/", _candidates(base, v2_path)[0], base)
        return cgroup.limit_bytes(), 2, cgroup.usage_bytes()
    cgroup = find_memory_cgroup(root)
    if cgroup is None:
        return None, None, None
    return cgroup.limit_bytes(), 1, cgroup.usage_bytes()


def read_cgroup_limit(root: Path = Path("/")) -> tuple[int | None, int | None]:
    """Memory limit of this process's cgroup (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``)."""
    limit, version, _usage = read_cgroup_memory(root)
    return limit, version


def read_numa_nodes(root: Path = Path("/")) -> list[NumaNode]:
    nodes_dir = root / "sys/devices/system/node"
    nodes = []
    for node_dir in sorted(nodes_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = parse_meminfo(_read(node_dir / "meminfo"))
        hugepages = {}
        for size_kb in (2048, 1048576):
            hugepages[size_kb] = int(
                _read(node_dir / f"hugepages/hugepages-{size_kb}kB/nr_hugepages", "0").strip() or 0
            )
        nodes.append(
            NumaNode(
                node_id=int(node_dir.name[4:]),
                memory_total_bytes=meminfo.get("MemTotal", 0),
                memory_free_bytes=meminfo.get("MemFree", 0),
                cpus=parse_cpu_list(_read(node_dir / "cpulist")),
                hugepages_2m=hugepages[2048],
                hugepages_1g=hugepages[1048576],
                memory_available_bytes=min(
                    meminfo.get("MemTotal", 0),
                    meminfo.get("MemFree", 0) + max(0, meminfo.get("FilePages", 0) - meminfo.get("Shmem", 0)),
                ),
            )
        )
    return nodes


def count_physical_cores(root: Path = Path("/"), cpus: list[int] | None = None) -> int:
    """Distinct (package, core) pairs among ``cpus`` (all online CPUs by default)."""
    cpu_root = root / "sys/devices/system/cpu"
    if cpus is None:
        cpus = parse_cpu_list(_read(cpu_root / "online")) or list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = cpu_root / f"cpu{cpu}/topology"
        package = _read(topology / "physical_package_id", "0").strip()
        core = _read(topology / "core_id", str(cpu)).strip()
        cores.add((package, core))
    return max(1, len(cores))


def read_cpu_flags(root: Path = Path("/")) -> list[str]:
    for line in _read(root / "proc/cpuinfo").splitlines():
        if line.startswith("flags"):
            return sorted(line.split(":", 1)[1].split())
    return []


# The AVX-512 subset oneDNN's avx512_core kernels need.
AVX512_CORE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})


# The CPU that planning answers for when it is not this machine's (:func:`as_cpu`).
_PLANNED_CPU: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "planned_cpu", default=None
)

# Flags that stand for each ISA class of :func:`cpu_isa` (the ones the kit's decisions read).
ISA_FLAGS = {
    "avx512+amx": AVX512_CORE_FLAGS
    | {"avx2", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
    "avx512+bf16": AVX512_CORE_FLAGS | {"avx2", "avx512_bf16", "avx512_vnni"},
    "avx512": AVX512_CORE_FLAGS | {"avx2"},
    "avx2": frozenset({"avx2"}),
    "other": frozenset(),
}


@functools.cache
def _read_this_cpu_flags() -> frozenset[str]:
    return frozenset(read_cpu_flags())


def this_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags, read once; within :func:`as_cpu`, those of the CPU planned for."""
    planned = _PLANNED_CPU.get()
    return _read_this_cpu_flags() if planned is None else planned


@contextlib.contextmanager
def as_cpu(isa: str) -> Iterator[None]:
    """Plan as on a CPU of ISA class ``isa`` (:func:`cpu_isa`'s names), not this machine's: what the model
    builds and the planner predicts on that CPU (oneDNN's kernels and buffers differ by ISA). Refitting a
    calibration file's runs uses the CPU they ran on; BadInput for a class it does not know."""
    if isa not in ISA_FLAGS:
        raise BadInput(f"unknown CPU class {isa!r}: one of {', '.join(ISA_FLAGS)}")
    token = _PLANNED_CPU.set(frozenset(ISA_FLAGS[isa]))
    try:
        yield
    finally:
        _PLANNED_CPU.reset(token)


def read_cpu_model(root: Path = Path("/")) -> str:
    for line in _read(root / "proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return " ".join(line.split(":", 1)[1].split())
    return ""


def cpu_isa(flags: list[str]) -> str:
    """The oneDNN instruction-set class of a CPU with these flags, which decides the convolution kernels
    and their buffers: avx512+amx, avx512+bf16 (native bf16 dot products, no AMX), avx512, avx2 or
    "other"."""
    present = set(flags)
    if AVX512_CORE_FLAGS <= present:
        if "amx_tile" in present:
            return "avx512+amx"
        return "avx512+bf16" if "avx512_bf16" in present else "avx512"
    return "avx2" if "avx2" in present else "other"


def read_host_facts(root: Path = Path("/")) -> HostFacts:
    """Read everything the planner and preflight need about this host."""
    meminfo = parse_meminfo(_read(root / "proc/meminfo"))
    limit, version, usage = read_cgroup_memory(root)
    if root == Path("/") and hasattr(os, "sched_getaffinity"):
        usable = sorted(os.sched_getaffinity(0))
    else:
        usable = parse_cpu_list(_read(root / "sys/devices/system/cpu/online"))
    hostname = _read(root / "proc/sys/kernel/hostname").strip() or os.uname().nodename
    return HostFacts(
        hostname=hostname,
        memory_total_bytes=meminfo.get("MemTotal", 0),
        memory_available_bytes=meminfo.get("MemAvailable", meminfo.get("MemFree", 0)),
        swap_total_bytes=meminfo.get("SwapTotal", 0),
        cgroup_limit_bytes=limit,
        cgroup_version=version,
        logical_cpus=len(usable) or (os.cpu_count() or 1),
        physical_cores=count_physical_cores(root, usable or None),
        usable_cpus=usable,
        numa_nodes=read_numa_nodes(root),
        thp_enabled=_bracketed(_read(root / "sys/kernel/mm/transparent_hugepage/enabled")),
        thp_defrag=_bracketed(_read(root / "sys/kernel/mm/transparent_hugepage/defrag")),
        hugepages_total=meminfo.get("HugePages_Total", 0),
        hugepage_size_bytes=meminfo.get("Hugepagesize", 0),
        cpu_flags=read_cpu_flags(root),
        kernel_cmdline=_read(root / "proc/cmdline").strip(),
        hugetlb_bytes=meminfo.get("Hugetlb", 0),
        swap_free_bytes=meminfo.get("SwapFree", 0),
        cgroup_usage_bytes=usage,
        cpu_model=read_cpu_model(root),
    )


def onednn_enabled(cpu_flags: list[str] | None = None) -> bool:
    """Whether TensorFlow will use oneDNN: TF_ENABLE_ONEDNN_OPTS when set; unset, stock TensorFlow turns
    it on only on x86 Linux CPUs with AVX512_VNNI, AVX512_BF16 or AMX (not on AVX2-only CPUs)."""
    flag = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    if flag is not None:
        return flag.strip().lower() in {"1", "true", "yes", "on"}
    if platform.system() != "Linux" or platform.machine() not in {"x86_64", "AMD64"}:
        return False
    flags = set(read_cpu_flags() if cpu_flags is None else cpu_flags)
    return bool(flags & {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"})


def preloaded_allocator() -> str:
    """The malloc this process really runs on: tcmalloc or jemalloc when mapped, else glibc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"
