"""Run-to-run spread of a whole run's peak: checkpoints streamed to disk (the kit) against Keras' writer.

The same job, measured as the planner is judged (``calibrate.measure_run``: `bigmem-train train` in its own
process, two epochs of two steps, validation, last/best checkpoints, BackupAndRestore, TensorBoard, the
sampler), alternating the two checkpoint writers run by run (``checkpoints.WRITER_ENVIRONMENT``). Keras'
writer stages each ``.keras`` file in memory (checkpoints.py); the freed buffers stay in the allocator's
heap, and how much of them the next steps reuse differs from one process to the next.

    python benchmarks/checkpoint_spread.py                       # 64x48x48 b2 f24 d4, 5 runs each
    python benchmarks/checkpoint_spread.py --job 96x96x64:8:8:4 --repeats 3
    python benchmarks/checkpoint_spread.py --json benchmarks/results/checkpoint_spread.json

Prints each run (peak GiB, median step s, load average) and per writer the lowest and highest peak and
their spread; ``--json`` also writes the runs and a strip plot next to it (``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bigmem_train.config import load_config
from bigmem_train.memory.calibrate import job_config, measure_run
from bigmem_train.train.checkpoints import WRITER_ENVIRONMENT

GIB = 2**30
WRITERS = {"streamed": None, "keras": "keras"}


def parse_job(text: str) -> dict:
    """``DxHxW:batch:filters:depth`` -> job_config's keywords (one channel, binary, float32)."""
    try:
        shape, batch, filters, depth = text.split(":")
        return {
            "shape": tuple(int(edge) for edge in shape.split("x")),
            "batch": int(batch),
            "filters": int(filters),
            "depth": int(depth),
            "channels": 1,
        }
    except ValueError as error:
        raise SystemExit(
            f"--job {text!r}: expected DxHxW:batch:filters:depth, e.g. 64x48x48:2:24:4"
        ) from error


def measure(job: dict, repeats: int) -> list[dict]:
    config = job_config(load_config(), **job)
    workdir = Path(tempfile.gettempdir()) / "bigmem-checkpoint-spread"
    runs = []
    for repeat in range(repeats):
        for writer, value in WRITERS.items():
            environment = os.environ.pop(WRITER_ENVIRONMENT, None)
            if value:
                os.environ[WRITER_ENVIRONMENT] = value
            load = os.getloadavg()[0]
            try:
                metrics = measure_run(config, workdir, f"spread-{writer}")
            finally:
                os.environ.pop(WRITER_ENVIRONMENT, None)
                if environment is not None:
                    os.environ[WRITER_ENVIRONMENT] = environment
            run = {
                "writer": writer,
                "repeat": repeat,
                "peak_rss_bytes": metrics["peak_rss_bytes"],
                "file_backed_at_start_bytes": metrics.get("file_backed_at_start_bytes"),
                "median_step_seconds": metrics.get("median_step_seconds"),
                "load_before": round(load, 2),
                "load_after": round(os.getloadavg()[0], 2),
            }
            runs.append(run)
            print(
                f"{writer:9s} run {repeat + 1}: peak {run['peak_rss_bytes'] / GIB:.3f} GiB, "
                f"step {run['median_step_seconds']} s, load {load:.2f}",
                flush=True,
            )
    return runs


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for writer in WRITERS:
        peaks = [run["peak_rss_bytes"] for run in runs if run["writer"] == writer]
        steps = [run["median_step_seconds"] for run in runs if run["writer"] == writer]
        summary[writer] = {
            "runs": len(peaks),
            "lowest_gib": round(min(peaks) / GIB, 3),
            "highest_gib": round(max(peaks) / GIB, 3),
            "spread": round((max(peaks) - min(peaks)) / min(peaks), 4),
            "median_step_seconds": round(statistics.median(steps), 3),
        }
        print(
            f"{writer:9s} {len(peaks)} runs: peak {min(peaks) / GIB:.3f}-{max(peaks) / GIB:.3f} GiB "
            f"(spread {summary[writer]['spread']:.1%}), median step {summary[writer]['median_step_seconds']} s"
        )
    loads = [run["load_before"] for run in runs]
    print(f"load average 1 min: {min(loads):.2f}-{max(loads):.2f}")
    return summary


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 4))
    for position, writer in enumerate(WRITERS):
        peaks = [run["peak_rss_bytes"] / GIB for run in result["runs"] if run["writer"] == writer]
        axis.scatter([position] * len(peaks), peaks, alpha=0.7)
    axis.set_xticks(range(len(WRITERS)), [f"{writer} writer" for writer in WRITERS])
    axis.set_xlim(-0.5, len(WRITERS) - 0.5)
    axis.set_ylabel("peak resident memory of the whole run (GiB)")
    axis.set_title(result["job"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", default="64x48x48:2:24:4", help="DxHxW:batch:filters:depth (one channel)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per writer, alternating")
    parser.add_argument("--json", type=Path, help="write the runs and summary here (and a .png next to it)")
    args = parser.parse_args()
    job = parse_job(args.job)
    runs = measure(job, args.repeats)
    result = {"job": args.job, "runs": runs, "summary": summarize(runs)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.json.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
