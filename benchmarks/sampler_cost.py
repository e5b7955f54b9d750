"""CPU cost of the memory sampler at a large resident size: the sampler as it was (smaps_rollup and psutil
every sample) against the sampler now (cheap counters every sample, page-table walks rarely).

One process holds ``--gib`` GiB of touched memory (4 KiB pages unless THP is "always") and runs each
sampler in turn for ``--seconds``, alternating ``--repetitions`` times, so the machine's other load hits
both alike. The figure is the sampler thread's own CPU time (its per-thread clock) per wall second.

    python benchmarks/sampler_cost.py --gib 9 --seconds 30 --repetitions 2

Prints one line per run and a summary; writes ``benchmarks/results/sampler_cost.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import csv
import json
import mmap
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from bigmem_train.train.monitor import MemorySampler

HERE = Path(__file__).resolve().parent


class PreviousSampler:
    """The sampler before this change (commit e1f33de): psutil RSS and /proc/self/smaps_rollup every sample."""

    def __init__(self, csv_path: Path, interval: float = 0.25):
        self.csv_path = csv_path
        self.interval = interval
        self.samples = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, writer) -> None:
        rss = self._process.memory_info().rss
        text = Path("/proc/self/smaps_rollup").read_text()
        match = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
        huge = int(match.group(1)) * 1024 if match else 0
        writer.writerow([f"{time.time():.3f}", rss, huge])
        self.samples += 1

    def _loop(self) -> None:
        with open(self.csv_path, "a", newline="") as handle:
            writer = csv.writer(handle)
            while True:
                self._sample(writer)
                handle.flush()
                if self._stop.wait(self.interval):
                    return

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="previous-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def thread_cpu_seconds(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def run_one(kind: str, seconds: float, interval: float, folder: Path) -> dict:
    path = folder / f"{kind}-{time.monotonic_ns()}.csv"
    sampler = PreviousSampler(path, interval) if kind == "previous" else MemorySampler(path, interval)
    sampler.start()
    started = time.monotonic()
    time.sleep(seconds)
    cpu = thread_cpu_seconds(sampler._thread)
    wall = time.monotonic() - started
    sampler.stop()
    result = {
        "sampler": kind,
        "wall_seconds": round(wall, 2),
        "thread_cpu_seconds": round(cpu, 4),
        "share_of_one_core": round(cpu / wall, 5),
        "samples": sampler.samples,
        "cpu_ms_per_sample": round(1000 * cpu / max(1, sampler.samples), 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    if kind == "current":
        result["page_table_walks"] = sampler.walks
        result["walk_ms_each"] = round(1000 * sampler.walk_seconds / max(1, sampler.walks), 1)
        result["measure"] = sampler.measure
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=9.0, help="touched memory to hold (GiB, default 9)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds per run (default 30)")
    parser.add_argument(
        "--repetitions", type=int, default=2, help="alternating runs of each sampler (default 2)"
    )
    parser.add_argument(
        "--interval", type=float, default=0.25, help="sample interval (default 0.25 s, the default)"
    )
    parser.add_argument(
        "--pages",
        choices=["4k", "thp"],
        default="4k",
        help="back the held memory with 4 KiB pages (default) or transparent huge pages",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "sampler_cost.json")
    args = parser.parse_args()

    size = int(args.gib * 2**30)
    # An anonymous mapping, touched page by page; 4 KiB pages (the most page-table entries to walk) unless
    # --pages thp asks for transparent huge pages.
    held = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    held.madvise(mmap.MADV_HUGEPAGE if args.pages == "thp" else mmap.MADV_NOHUGEPAGE)
    np.frombuffer(held, dtype=np.uint8)[:: mmap.PAGESIZE] = 1
    rss = psutil.Process().memory_info().rss
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    huge = re.search(r"^AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text(), re.MULTILINE)
    print(
        f"holding {rss / 2**30:.2f} GiB resident (THP {thp}, {int(huge.group(1)) / 2**20:.2f} GiB in huge "
        f"pages); load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repetitions):
            for kind in ("previous", "current"):
                result = run_one(kind, args.seconds, args.interval, Path(folder))
                runs.append(result)
                print(json.dumps(result), flush=True)
    held.close()
    summary = {}
    for kind in ("previous", "current"):
        shares = [run["share_of_one_core"] for run in runs if run["sampler"] == kind]
        summary[kind] = {"share_of_one_core_min": min(shares), "share_of_one_core_max": max(shares)}
    previous = sum(run["thread_cpu_seconds"] for run in runs if run["sampler"] == "previous")
    current = sum(run["thread_cpu_seconds"] for run in runs if run["sampler"] == "current")
    summary["previous_over_current_cpu"] = round(previous / current, 1) if current else None
    before, after = summary["previous"], summary["current"]
    print(
        f"sampler CPU share of one core at {rss / 2**30:.1f} GiB resident: previous "
        f"{before['share_of_one_core_min']:.2%}-{before['share_of_one_core_max']:.2%}, "
        f"current {after['share_of_one_core_min']:.3%}-{after['share_of_one_core_max']:.3%} "
        f"(previous/current CPU {summary['previous_over_current_cpu']}x)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "resident_bytes": rss,
                "thp": thp,
                "pages": args.pages,
                "interval_seconds": args.interval,
                "runs": runs,
                "summary": summary,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
