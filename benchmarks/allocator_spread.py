"""Peak and step time of whole runs under different allocators and transparent-huge-page modes.

The planner's worst misses (docs/design/planner.md, "The recomputed jobs' spread") are runs of the same job whose
peaks part by up to a fifth: tcmalloc's page heap reusing freed spans differently from run to run. The
allocators that do not strand spans (jemalloc's defaults, tcmalloc's aggressive decommit) page-fault every
large tensor afresh and cost about 2x the step with 4 KiB pages. With transparent huge pages a fault maps
2 MiB at once, and the kit's Ansible play sets THP to "always" on the servers it provisions
(``bigmem_os_tuning_thp_enabled``), so this measures both the runs as a provisioned host sees them and the
allocators that might end the spread there. Further variants fix who allocates beside the step (the reader's
threads, the kernels' worker threads, Python's cyclic collector) or where the heap's memory comes from
(address-space randomisation, sbrk) one by one and together, to find what parts the runs (docs/design/planner.md,
"What parts the runs").

Each variant runs the job as the planner's sweep does (``measure_run``: `bigmem-train train`, two epochs of
two steps with validation, checkpoints, TensorBoard and the sampler) , one run at a time, variants interleaved
(A B C A B C ...) so that drift in the machine's load falls on all of them. THP modes are switched through
``/sys/kernel/mm/transparent_hugepage/enabled`` (root) and put back as they were at the end.

    python benchmarks/allocator_spread.py --job 160 160 112 2 16 --recompute --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bigmem_train.config import load_config
from bigmem_train.memory.calibrate import job_config, measure_run
from bigmem_train.memory.constants import load_calibration
from bigmem_train.memory.estimate import estimate

GIB = 2**30
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# name -> (runtime.allocator, THP mode, extra environment)
VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "tcmalloc, THP madvise": ("tcmalloc", "madvise", {}),
    "tcmalloc, THP always": ("tcmalloc", "always", {}),
    # No huge pages at all: numpy madvises its large arrays (the reader's volumes) for them, so even under
    # madvise a run holds some, and khugepaged collapses such regions whenever its scan reaches them.
    "tcmalloc, THP never": ("tcmalloc", "never", {}),
    "tcmalloc aggressive decommit, THP madvise": (
        "tcmalloc",
        "madvise",
        {"TCMALLOC_AGGRESSIVE_DECOMMIT": "true"},
    ),
    "tcmalloc aggressive decommit, THP always": (
        "tcmalloc",
        "always",
        {"TCMALLOC_AGGRESSIVE_DECOMMIT": "true"},
    ),
    # gperftools' incremental scavenger: after it hands back N pages it waits 1000 N / rate freed pages
    # before the next (page_heap.cc, IncrementalScavenge; default rate 1).
    "tcmalloc release rate 10, THP madvise": ("tcmalloc", "madvise", {"TCMALLOC_RELEASE_RATE": "10"}),
    "tcmalloc release rate 100, THP madvise": ("tcmalloc", "madvise", {"TCMALLOC_RELEASE_RATE": "100"}),
    "tcmalloc release rate 1000, THP madvise": ("tcmalloc", "madvise", {"TCMALLOC_RELEASE_RATE": "1000"}),
    "jemalloc thp:always, THP madvise": (
        "jemalloc",
        "madvise",
        {"MALLOC_CONF": "thp:always,metadata_thp:auto"},
    ),
    "jemalloc, THP always": ("jemalloc", "always", {}),
    # jemalloc 5 gives every block over 8 MiB (oversize_threshold) to an arena that purges at once; with
    # the threshold at 0 large blocks stay in the ordinary arenas, whose freed pages are kept for reuse and
    # purged after dirty_decay_ms (default 10 s; -1: never).
    "jemalloc large blocks kept 10 s, THP madvise": (
        "jemalloc",
        "madvise",
        {"MALLOC_CONF": "oversize_threshold:0"},
    ),
    "jemalloc large blocks never purged, THP madvise": (
        "jemalloc",
        "madvise",
        {"MALLOC_CONF": "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"},
    ),
    "glibc, THP always": ("glibc", "always", {}),
    # mimalloc (Debian's libmimalloc2.0), preloaded by hand over glibc: not one of the kit's allocators.
    "mimalloc, THP madvise": (
        "glibc",
        "madvise",
        {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"},
    ),
}


# name -> data settings, with the kit's allocator and THP madvise (as its plain variant above): who
# allocates beside the training step.
DATA_VARIANTS: dict[str, dict[str, object]] = {
    "tcmalloc, reader in the step (parallel_reads 0, prefetch 0)": {
        "parallel_reads": 0,
        "prefetch_batches": 0,
    },
}
VARIANTS.update({name: ("tcmalloc", "madvise", {}) for name in DATA_VARIANTS})

# name -> runtime settings, with the kit's allocator and THP madvise: who allocates inside the step. With
# one intra-op thread (and the ops inline, the kit's default) one thread runs every kernel of the step.
RUNTIME_VARIANTS: dict[str, dict[str, object]] = {
    "tcmalloc, one intra-op thread": {"intra_op_threads": 1},
}
# Both at once: one thread reads each sample when the step asks for it and runs every kernel.
ONE_ORDER = "tcmalloc, reader in the step and one intra-op thread"
DATA_VARIANTS[ONE_ORDER] = DATA_VARIANTS["tcmalloc, reader in the step (parallel_reads 0, prefetch 0)"]
RUNTIME_VARIANTS[ONE_ORDER] = RUNTIME_VARIANTS["tcmalloc, one intra-op thread"]
VARIANTS.update({name: ("tcmalloc", "madvise", {}) for name in RUNTIME_VARIANTS})
# ... and Python's cyclic garbage collector off (a sitecustomize on PYTHONPATH calls gc.disable()): when it
# runs depends on every Python thread's allocations (the sampler's too), and what it frees (tensors held in
# reference cycles) would then come back to the heap at a different point of the step in every run.
NO_GC = "tcmalloc, reader in the step, one intra-op thread, no cyclic GC"
NO_GC_SITE = Path(tempfile.gettempdir()) / "bigmem-allocator-spread-no-gc"
DATA_VARIANTS[NO_GC] = DATA_VARIANTS[ONE_ORDER]
RUNTIME_VARIANTS[NO_GC] = RUNTIME_VARIANTS[ONE_ORDER]
NO_GC_ENV = {"PYTHONPATH": str(NO_GC_SITE)}
VARIANTS[NO_GC] = ("tcmalloc", "madvise", NO_GC_ENV)
VARIANTS["tcmalloc, no cyclic GC"] = ("tcmalloc", "madvise", NO_GC_ENV)
# name -> output settings, as DATA_VARIANTS.
OUTPUT_VARIANTS: dict[str, dict[str, object]] = {}
# name -> validation cases of the whole run (measure_run's default: one, a validation batch of one sample).
VALIDATION_CASES: dict[str, int] = {}


def slug(name: str) -> str:
    """A variant's name as a folder name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:80]


def derive(name: str, base: str, runtime=None, data=None, output=None, validation_cases=None) -> str:
    """Register variant ``name``: ``base``'s settings (the kit's allocator, THP madvise) with these on top."""
    RUNTIME_VARIANTS[name] = {**RUNTIME_VARIANTS.get(base, {}), **(runtime or {})}
    DATA_VARIANTS[name] = {**DATA_VARIANTS.get(base, {}), **(data or {})}
    OUTPUT_VARIANTS[name] = {**OUTPUT_VARIANTS.get(base, {}), **(output or {})}
    VALIDATION_CASES[name] = validation_cases or VALIDATION_CASES.get(base, 1)
    VARIANTS[name] = ("tcmalloc", "madvise", {})
    return name


# The one-order recipe's own variants (the collector at step ends, runtime.python_gc, was removed by the
# knob review: it did not end the parting; docs/planner.md).
# Runs of the recipe above part at the first step after the first validation and checkpoints; TensorBoard's
# event writer is one party there that is not the step's.
derive(f"{ONE_ORDER}, no TensorBoard", ONE_ORDER, output={"tensorboard": False})
# ... and TensorFlow's executor held to one inter-op thread instead of running ops inline (which still ran
# them on two threads, partly side by side): every op of the step, one at a time, in one thread.
derive(
    f"{ONE_ORDER}, one inter-op thread",
    ONE_ORDER,
    runtime={"inline_ops": False, "inter_op_threads": 1},
)
# ... with the ops inline but the kit's memory sampler (a Python thread reading /proc) all but off: one
# sample a minute. Its peak is then a lower bound; the end state (what the run keeps mapped) still shows.
derive(f"{ONE_ORDER}, one memory sample a minute", ONE_ORDER, output={"sample_interval": 60.0})
# ... with validation batches the size of the training batch. The whole run validates one case, so its
# validation pass runs the forward pass at batch 1 between training steps at the job's batch: tensors of a
# third (at batch 3) of the training step's sizes, which tcmalloc may cut from the large freed spans the
# next training step would reuse. ``--job``'s batch cases validate here, one full batch.
FULL_VALIDATION_BATCH = f"{ONE_ORDER}, validation a full batch"
derive(FULL_VALIDATION_BATCH, ONE_ORDER)

# Where the heap's memory comes from. gperftools grows its page heap with sbrk and falls back to mmap when
# the break cannot grow; a freed span merges only with a span at the next address, so whether two growths
# land side by side (address-space randomisation, other threads' mappings made in between) could change
# what the heap can reuse. ASLR is switched through /proc/sys/kernel/randomize_va_space (root), put back
# at the end; TCMALLOC_SKIP_SBRK makes every growth an mmap.
ASLR = Path("/proc/sys/kernel/randomize_va_space")
NO_ASLR = "tcmalloc, address-space randomisation off"
VARIANTS[NO_ASLR] = ("tcmalloc", "madvise", {})
VARIANTS["tcmalloc, mmap only (TCMALLOC_SKIP_SBRK)"] = (
    "tcmalloc",
    "madvise",
    {"TCMALLOC_SKIP_SBRK": "true"},
)


def thp_mode() -> str:
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--job", nargs=5, type=int, metavar=("X", "Y", "Z", "BATCH", "FILTERS"), required=True
    )
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--classes", type=int, default=1)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--runs", type=int, default=3, help="runs per variant")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--heap-limit-mib",
        type=int,
        action="append",
        default=[],
        help="also run tcmalloc (THP as found) with TCMALLOC_HEAP_LIMIT_MB at this many MiB (repeatable)",
    )
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument(
        "--keep", type=Path, help="copy each run's memory.csv and steps.csv here (one folder per run)"
    )
    args = parser.parse_args()
    for name in args.variants:
        preload = VARIANTS[name][2].get("LD_PRELOAD")
        if preload and not Path(preload).is_file():
            parser.error(f"variant {name!r} needs {preload} (apt-get install libmimalloc2.0)")
    for limit in args.heap_limit_mib:
        name = f"tcmalloc, heap limit {limit} MiB"
        VARIANTS[name] = ("tcmalloc", thp_mode(), {"TCMALLOC_HEAP_LIMIT_MB": str(limit)})
        args.variants.append(name)
    x, y, z, batch, filters = args.job
    config = job_config(
        load_config(),
        shape=(x, y, z),
        batch=batch,
        filters=filters,
        depth=args.depth,
        channels=args.channels,
        classes=args.classes,
        recompute=args.recompute,
    )
    VALIDATION_CASES[FULL_VALIDATION_BATCH] = batch
    planned = sum(estimate(config, load_calibration()).values())
    workdir = Path(tempfile.gettempdir()) / "bigmem-allocator-spread"
    if any(VARIANTS[name][2] is NO_GC_ENV for name in args.variants):
        NO_GC_SITE.mkdir(exist_ok=True)
        (NO_GC_SITE / "sitecustomize.py").write_text("import gc\n\ngc.disable()\n")
    original = thp_mode()
    original_aslr = ASLR.read_text().strip()
    runs: list[dict] = []
    try:
        for repeat in range(args.runs):
            for name in args.variants:
                allocator, mode, extra = VARIANTS[name]
                THP.write_text(mode)
                ASLR.write_text("0" if name == NO_ASLR else original_aslr)
                runtime = {"allocator": allocator, **RUNTIME_VARIANTS.get(name, {})}
                run_config = config.model_copy(
                    update={
                        "runtime": config.runtime.model_copy(update=runtime),
                        "data": config.data.model_copy(update=DATA_VARIANTS.get(name, {})),
                        "output": config.output.model_copy(update=OUTPUT_VARIANTS.get(name, {})),
                    }
                )
                saved = {key: os.environ.get(key) for key in extra}
                os.environ.update(extra)
                load = os.getloadavg()[0]
                try:
                    metrics = measure_run(
                        run_config,
                        workdir,
                        "run",
                        keep=bool(args.keep),
                        validation_cases=VALIDATION_CASES.get(name, 1),
                    )
                    if args.keep:
                        kept = args.keep / f"{len(runs):02d}-{slug(name)}"
                        kept.mkdir(parents=True, exist_ok=True)
                        for record in ("memory.csv", "steps.csv"):
                            shutil.copy(workdir / "run" / record, kept / record)
                finally:
                    for key, value in saved.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value
                row = {
                    "variant": name,
                    "repeat": repeat,
                    "peak_gib": round(metrics["peak_rss_bytes"] / GIB, 3),
                    "thp_at_peak_gib": round(metrics.get("peak_anon_hugepages_bytes", 0) / GIB, 3),
                    "step_seconds": metrics.get("median_step_seconds"),
                    "allocator": metrics.get("allocator"),
                    "load_before": round(load, 2),
                    "load_after": round(os.getloadavg()[0], 2),
                    "time": time.strftime("%H:%M:%S"),
                }
                runs.append(row)
                print(json.dumps(row), flush=True)
    finally:
        THP.write_text(original)
        ASLR.write_text(original_aslr)
    print(f"\nplanned {planned / GIB:.3f} GiB")
    for name in args.variants:
        rows = [row for row in runs if row["variant"] == name]
        peaks = [row["peak_gib"] for row in rows]
        steps = [row["step_seconds"] for row in rows if row["step_seconds"]]
        print(
            f"{name:45s} peaks {', '.join(f'{p:.2f}' for p in peaks)} GiB (spread {max(peaks) - min(peaks):.2f}); "
            f"step {statistics.median(steps):.1f} s"
        )
    if args.json:
        job = {
            "shape": [x, y, z],
            "batch": batch,
            "filters": filters,
            "depth": args.depth,
            "channels": args.channels,
            "classes": args.classes,
            "recompute": args.recompute,
        }
        args.json.write_text(
            json.dumps({"job": job, "planned_gib": planned / GIB, "runs": runs}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
