"""Hold a run to its plan: cap tcmalloc's heap so that freed pages are handed back before the heap grows
past the planned peak plus ``footprint.tolerance``.

tcmalloc keeps the pages a run frees mapped for reuse, and from run to run it fails to reuse some of them
for a new full-size tensor and maps more: the same job peaks up to a sixth apart between runs
(docs/design/planner.md, "Holding a run to its plan"; 240x240x144 b1 f8 with gradient recomputation: 3.87 to 4.48
GiB in three runs, 4.65 in the accuracy sweep). What the job really holds is lower and repeatable (3.27-3.33
GiB with every freed span returned at once), but returning every span costs 1.7x the step. gperftools'
heap limit (``TCMALLOC_HEAP_LIMIT_MB``) does it only when it matters: when the heap would grow past the
limit, tcmalloc first returns free spans to the kernel, and only if that is not enough does the allocation
fail.

The limit is set from inside the training process once TensorFlow, the model and the reader are loaded,
from what the process then maps outside tcmalloc's heap (libraries, interpreter arenas, thread stacks):
heap limit = cap - (resident set - tcmalloc's committed heap). ``runtime.heap_limit``: "plan" caps the
process at the planned peak plus ``footprint.tolerance`` (what the verdict allows anyway); a size ("64GiB",
"80%" of the host) caps it there; "off" (the default, and always for the calibration's runs, which measure
the unheld peak the constants are fitted to) leaves tcmalloc alone. Opt-in because a job that really needs
more than its cap fails at whichever allocation is refused: a TensorFlow tensor fails cleanly
(``ResourceExhaustedError``, turned into a memory stop, exit 3), a kernel's own scratch memory can end the
process with a segmentation fault.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any

from bigmem_train.host import preloaded_allocator
from bigmem_train.train.monitor import rss_parts

# gperftools' flag (an exported int64 in MiB, read each time the page heap would grow).
_FLAG = "_ZN61FLAG__namespace_do_not_use_directly_use_DECLARE_int64_instead28FLAGS_tcmalloc_heap_limit_mbE"
MIB = 1 << 20


@dataclass(frozen=True)
class HeapLimit:
    """A heap limit in force: the cap on the process, what lies outside the heap, and the heap's limit."""

    cap_bytes: int
    outside_heap_bytes: int
    limit_bytes: int
    source: str  # "plan + 10%" (the tolerance) or the configured size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tcmalloc_stats() -> dict[str, int]:
    """gperftools' heap counters (bytes) when tcmalloc is preloaded, else {}: what the program holds
    (allocated), what tcmalloc keeps mapped for reuse (free in the page heap) and what it returned."""
    try:
        library = ctypes.CDLL(None)
        get = library.MallocExtension_GetNumericProperty
    except (OSError, AttributeError):
        return {}
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    stats = {}
    for name in (
        "generic.current_allocated_bytes",
        "generic.heap_size",
        "tcmalloc.pageheap_free_bytes",
        "tcmalloc.pageheap_unmapped_bytes",
    ):
        value = ctypes.c_size_t(0)
        if get(name.encode(), ctypes.byref(value)):
            stats[name.split(".", 1)[1]] = int(value.value)
    return stats


def _flag() -> ctypes.c_int64 | None:
    if preloaded_allocator() != "tcmalloc":
        return None
    try:
        return ctypes.c_int64.in_dll(ctypes.CDLL(None), _FLAG)
    except ValueError:  # a tcmalloc build without the flag
        return None


def committed_heap_bytes(stats: dict[str, int] | None = None) -> int | None:
    """tcmalloc's heap as the kernel sees it (mapped, in use or free, less what it returned), or None;
    from ``stats`` (``tcmalloc_stats()``) when given."""
    stats = tcmalloc_stats() if stats is None else stats
    if "heap_size" not in stats:
        return None
    return stats["heap_size"] - stats.get("pageheap_unmapped_bytes", 0)


def current_limit_bytes() -> int | None:
    """The heap limit tcmalloc enforces now (0: none), or None without a tcmalloc that has one."""
    flag = _flag()
    return None if flag is None else flag.value * MIB


def hold(cap_bytes: int, source: str) -> HeapLimit | None:
    """Cap this process's resident memory at ``cap_bytes`` through tcmalloc's heap limit; None where the
    preloaded allocator is not a tcmalloc with a heap limit, or where the cap leaves the heap no more than
    it holds in use already (the plan is wrong before training starts; the verdict says so)."""
    flag = _flag()
    stats = tcmalloc_stats()
    committed = committed_heap_bytes(stats)
    if flag is None or committed is None:
        return None
    in_use = stats.get("current_allocated_bytes", committed)
    outside = max(0, rss_parts()[0] - committed)
    limit = cap_bytes - outside
    if limit <= in_use:
        return None
    flag.value = limit // MIB
    return HeapLimit(
        cap_bytes=cap_bytes, outside_heap_bytes=outside, limit_bytes=flag.value * MIB, source=source
    )


def release() -> None:
    """Lift the limit (a run that stopped on it writes its checkpoint and report without it)."""
    flag = _flag()
    if flag is not None:
        flag.value = 0
