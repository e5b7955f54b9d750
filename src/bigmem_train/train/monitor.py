"""Memory sampler running beside training: resident memory (RSS), the charge of the run's own cgroup and the
limit in force, anonymous huge pages and per-NUMA-node resident memory.

Two kinds of reads, so the sampler's own cost stays far below 1 % of one core at any footprint:

* cheap counters every ``interval`` (default 0.25 s): ``/proc/self/statm`` (RSS and its file-backed part
  from the kernel's per-process counters), the cgroup's ``memory.current`` / ``memory.usage_in_bytes``
  and, without a cgroup limit, ``/proc/meminfo``'s MemAvailable. Each is a handful of microseconds
  whatever the footprint.
* page-table walks rarely: ``/proc/self/smaps_rollup`` (anonymous huge pages) and ``/proc/self/numa_maps``
  (per node) walk every page table of the process, which costs time in proportion to the footprint (tens of
  milliseconds at 13 GB, seconds at a terabyte). They run at most every ``walk_interval`` seconds and never
  more often than keeps their share of one core under ``walk_share``; between walks the last values are
  repeated in memory.csv.

The judged measure ("measured" memory) is the cgroup's working set when the process's memory cgroup has a
limit (what that limit and the cgroup's OOM killer act on: the charge less inactive page cache, as ``docker
stats`` and the kubelet count it), else RSS: an unlimited cgroup is often shared (a login session, a CI
job) and its charge is then other processes' memory too. ``usable`` is the cgroup limit (capped by what
the host has left), or without a limit, measured memory plus the host's MemAvailable.

Writes ``memory.csv`` (appending on resume) and keeps the peaks.
"""

from __future__ import annotations

import csv
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bigmem_train.host import MemoryCgroup, find_memory_cgroup

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MEMAVAILABLE = re.compile(rb"^MemAvailable:\s+(\d+) kB", re.MULTILINE)

# memory.csv columns before the per-node ones.
CSV_COLUMNS = [
    "time_unix",
    "elapsed_s",
    "rss_bytes",
    "rss_file_bytes",
    "anon_hugepages_bytes",
    "charged_bytes",
    "working_set_bytes",
    "usable_bytes",
]


def anon_hugepages_bytes(pid: int | str = "self") -> int:
    """AnonHugePages of a process (transparent huge pages backing its anonymous memory); walks its page tables."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    match = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def numa_node_bytes(pid: int | str = "self") -> dict[int, int]:
    """Resident pages of a process per NUMA node, from /proc/PID/numa_maps (``N<node>=<pages>``); walks its
    page tables."""
    totals: dict[int, int] = {}
    try:
        with open(f"/proc/{pid}/numa_maps") as handle:
            for line in handle:
                page_size = _PAGE_SIZE
                kernel_page = re.search(r"kernelpagesize_kB=(\d+)", line)
                if kernel_page:
                    page_size = int(kernel_page.group(1)) * 1024
                for node, pages in re.findall(r"\bN(\d+)=(\d+)", line):
                    totals[int(node)] = totals.get(int(node), 0) + int(pages) * page_size
    except OSError:
        return {}
    return totals


def peak_rss_bytes() -> int:
    """This process's peak resident set since its exec: VmHWM of /proc/self/status, the high-water mark of
    its own address space. Not getrusage's ``ru_maxrss``: the kernel carries that over from the process
    that started this one (at fork and through exec), so a run started by a large process (a test
    runner, a notebook, a relaunch) would report that process's peak as its own."""
    try:
        with open("/proc/self/status", "rb") as handle:
            for line in handle:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # no /proc (not Linux): the only figure there is

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size from /proc/PID/statm: the kernel's counters, no page-table walk."""
    return rss_parts(pid)[0]


def rss_parts(pid: int | str = "self") -> tuple[int, int]:
    """Resident set size and its file-backed part (mapped libraries and files, plus shared memory: statm's
    ``shared``, RssFile + RssShmem), from /proc/PID/statm. The file-backed part depends on the page cache as
    well as on the process: a library read sequentially into the cache (``pip install``, ``cp``) sits in
    large folios that a fault maps whole, so the same run maps more of it."""
    with open(f"/proc/{pid}/statm", "rb") as handle:
        fields = handle.read().split()
    return int(fields[1]) * _PAGE_SIZE, int(fields[2]) * _PAGE_SIZE


def memavailable_bytes() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as handle:
            match = _MEMAVAILABLE.search(handle.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


@dataclass
class MemorySample:
    """One look at this process's memory. ``measured_bytes`` is the judged measure (see the module)."""

    time_unix: float
    rss_bytes: int
    charged_bytes: int | None
    working_set_bytes: int | None
    usable_bytes: int | None
    measure: str
    rss_file_bytes: int = 0

    @property
    def measured_bytes(self) -> int:
        if self.measure == "rss" or self.working_set_bytes is None:
            return self.rss_bytes
        return self.working_set_bytes


def measure_name(cgroup: MemoryCgroup | None) -> str:
    """How the judged measure is named in metrics.json, the verdict and the report."""
    if cgroup is None or cgroup.limit_bytes() is None:
        return "rss"
    return f"cgroup v{cgroup.version} working set"


class MemoryProbe:
    """The cheap reads of one sample (RSS, cgroup charge, limit, MemAvailable), shared by the sampler and
    the guard. The limit is re-read every ``limit_refresh`` seconds (``docker update`` can change it)."""

    def __init__(self, cgroup: MemoryCgroup | None | str = "auto", limit_refresh: float = 10.0):
        self.cgroup = find_memory_cgroup() if cgroup == "auto" else cgroup
        self.measure = measure_name(self.cgroup)
        self.limit_refresh = limit_refresh
        self._limit: int | None = None
        self._limit_read = float("-inf")
        self._inactive_file = 0
        # The working set is exact when the charge is above this many bytes (refreshed there each sample).
        self.exact_above: int | None = None

    def limit_bytes(self, now: float) -> int | None:
        if self.cgroup is not None and now - self._limit_read >= self.limit_refresh:
            self._limit = self.cgroup.limit_bytes()
            self._limit_read = now
        return self._limit

    def refresh_page_cache(self) -> None:
        """Re-read the cgroup's inactive page cache (memory.stat: more than one counter)."""
        if self.cgroup is not None:
            self._inactive_file = self.cgroup.inactive_file_bytes()

    def read(self) -> MemorySample:
        now = time.time()
        rss, rss_file = rss_parts()
        charged = working_set = None
        limit = None
        if self.cgroup is not None:
            charged = self.cgroup.usage_bytes()
            limit = self.limit_bytes(now)
            if charged is not None:
                if self.exact_above is not None and charged >= self.exact_above:
                    self.refresh_page_cache()
                working_set = max(0, charged - min(self._inactive_file, charged))
        measured = rss if self.measure == "rss" or working_set is None else working_set
        available = memavailable_bytes()
        # What the host still has caps a cgroup limit set above it (or no limit at all).
        host_room = measured + available if available is not None else None
        usable = (
            min(value for value in (limit, host_room) if value is not None)
            if (limit is not None or host_room is not None)
            else None
        )
        return MemorySample(now, rss, charged, working_set, usable, self.measure, rss_file)


class MemorySampler:
    """Samples this process's memory every ``interval`` seconds in a daemon thread.

    ``listeners`` are called with each :class:`MemorySample` from the sampler thread (the memory guard
    is one); they must be quick. ``cpu_seconds`` is the CPU time the sampler thread has used.
    """

    def __init__(
        self,
        csv_path: Path,
        interval: float = 0.25,
        numa_nodes: list[int] | None = None,
        probe: MemoryProbe | None = None,
        walk_interval: float = 30.0,
        walk_share: float = 0.002,
        listeners: list[Callable[[MemorySample], None]] | None = None,
    ):
        self.csv_path = Path(csv_path)
        self.interval = interval
        self.numa_nodes = numa_nodes if numa_nodes and len(numa_nodes) > 1 else []
        self.probe = probe or MemoryProbe()
        self.walk_interval = walk_interval
        self.walk_share = walk_share
        self.listeners = list(listeners or [])
        self.peak_rss_bytes = 0
        self.peak_charged_bytes = 0
        self.peak_working_set_bytes = 0
        self.peak_anon_hugepages_bytes = 0
        self.peak_node_bytes: dict[int, int] = {}
        self.samples = 0
        self.walks = 0
        self.walk_seconds = 0.0
        self.cpu_seconds = 0.0
        self.last: MemorySample | None = None
        self._anon_hugepages = 0
        self._node_bytes: dict[int, int] = {}
        self._next_walk = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_time = time.time()

    @property
    def measure(self) -> str:
        return self.probe.measure

    def _header(self) -> list[str]:
        return CSV_COLUMNS + [f"node{node}_bytes" for node in self.numa_nodes]

    def _walk(self, now: float) -> None:
        """The page-table walks, then the next walk no sooner than keeps them under ``walk_share`` of a core."""
        started = time.thread_time()
        self._anon_hugepages = anon_hugepages_bytes()
        if self.numa_nodes:
            self._node_bytes = numa_node_bytes()
        self.probe.refresh_page_cache()
        cost = time.thread_time() - started
        self.walks += 1
        self.walk_seconds += cost
        self._next_walk = now + max(self.walk_interval, cost / self.walk_share)

    def sample(self, writer=None, walk: bool | None = None) -> MemorySample:
        """Take one sample (with the page-table walks when due, or when ``walk`` says so) and write its row."""
        now = time.monotonic()
        if walk or (walk is None and now >= self._next_walk):
            self._walk(now)
        sample = self.probe.read()
        self.last = sample
        self.peak_rss_bytes = max(self.peak_rss_bytes, sample.rss_bytes)
        self.peak_charged_bytes = max(self.peak_charged_bytes, sample.charged_bytes or 0)
        self.peak_working_set_bytes = max(self.peak_working_set_bytes, sample.working_set_bytes or 0)
        self.peak_anon_hugepages_bytes = max(self.peak_anon_hugepages_bytes, self._anon_hugepages)
        row = [
            f"{sample.time_unix:.3f}",
            f"{sample.time_unix - self._start_time:.3f}",
            sample.rss_bytes,
            sample.rss_file_bytes,
            self._anon_hugepages,
            _blank(sample.charged_bytes),
            _blank(sample.working_set_bytes),
            _blank(sample.usable_bytes),
        ]
        for node in self.numa_nodes:
            value = self._node_bytes.get(node, 0)
            self.peak_node_bytes[node] = max(self.peak_node_bytes.get(node, 0), value)
            row.append(value)
        self.samples += 1
        if writer is not None:
            writer.writerow(row)
        for listener in self.listeners:
            listener(sample)
        return sample

    def _loop(self) -> None:
        new_file = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        existing = None if new_file else _csv_header(self.csv_path)
        with open(self.csv_path, "a", newline="") as handle:
            writer = csv.writer(handle)
            if new_file:
                writer.writerow(self._header())
            elif existing and existing != self._header():
                # A resumed run keeps its file's columns (one written by an earlier version, or with
                # other NUMA nodes): each row goes under them, a column this version lacks left blank.
                writer = _ColumnWriter(writer, self._header(), existing)
            try:
                while True:
                    self.sample(writer)
                    handle.flush()
                    self.cpu_seconds = time.thread_time()
                    if self._stop.wait(self.interval):
                        # The last row carries fresh walks too, so the run's record ends exact.
                        self.sample(writer, walk=True)
                        return
            finally:
                self.cpu_seconds = time.thread_time()

    def start(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _blank(value: int | None) -> int | str:
    return "" if value is None else value


def _csv_header(path: Path) -> list[str] | None:
    try:
        with open(path, newline="") as handle:
            return next(csv.reader(handle), None)
    except OSError:
        return None


class _ColumnWriter:
    """Writes rows laid out as ``ours`` under the columns ``theirs`` of a file being appended to."""

    def __init__(self, writer, ours: list[str], theirs: list[str]):
        self.writer = writer
        index = {name: position for position, name in enumerate(ours)}
        self.positions = [index.get(name) for name in theirs]

    def writerow(self, row: list) -> None:
        self.writer.writerow(["" if position is None else row[position] for position in self.positions])
