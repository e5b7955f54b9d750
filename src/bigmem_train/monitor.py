"""Memory sampler running beside training: RSS, anonymous huge pages and per-NUMA-node resident memory.

Writes ``memory.csv`` (appending on resume) and keeps the peak. Reads /proc directly (psutil for RSS),
so it costs well under a millisecond a sample.
"""

from __future__ import annotations

import csv
import os
import re
import threading
import time
from pathlib import Path

import psutil

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anon_hugepages_bytes(pid: int | str = "self") -> int:
    """AnonHugePages of a process (transparent huge pages backing its anonymous memory)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    match = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def numa_node_bytes(pid: int | str = "self") -> dict[int, int]:
    """Resident pages of a process per NUMA node, from /proc/PID/numa_maps (``N<node>=<pages>``)."""
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


class MemorySampler:
    """Samples this process's memory every ``interval`` seconds in a daemon thread."""

    def __init__(self, csv_path: Path, interval: float = 0.25, numa_nodes: list[int] | None = None):
        self.csv_path = Path(csv_path)
        self.interval = interval
        self.numa_nodes = numa_nodes if numa_nodes and len(numa_nodes) > 1 else []
        self.peak_rss_bytes = 0
        self.peak_anon_hugepages_bytes = 0
        self.peak_node_bytes: dict[int, int] = {}
        self.samples = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_time = time.time()

    def _header(self) -> list[str]:
        return ["time_unix", "elapsed_s", "rss_bytes", "anon_hugepages_bytes"] + [
            f"node{node}_bytes" for node in self.numa_nodes
        ]

    def sample(self, writer: csv.writer | None = None) -> None:
        rss = self._process.memory_info().rss
        huge = anon_hugepages_bytes()
        row = [f"{time.time():.3f}", f"{time.time() - self._start_time:.3f}", rss, huge]
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        self.peak_anon_hugepages_bytes = max(self.peak_anon_hugepages_bytes, huge)
        if self.numa_nodes:
            per_node = numa_node_bytes()
            for node in self.numa_nodes:
                value = per_node.get(node, 0)
                self.peak_node_bytes[node] = max(self.peak_node_bytes.get(node, 0), value)
                row.append(value)
        self.samples += 1
        if writer is not None:
            writer.writerow(row)

    def _loop(self) -> None:
        new_file = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        with open(self.csv_path, "a", newline="") as handle:
            writer = csv.writer(handle)
            if new_file:
                writer.writerow(self._header())
            while True:
                self.sample(writer)
                handle.flush()
                if self._stop.wait(self.interval):
                    self.sample(writer)
                    return

    def start(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
