"""How a whole run's peak grows with the batch: the same job at several batch sizes, each a whole run as
the planner's sweep measures it (``measure_run``: `bigmem-train train`, two epochs of two steps with
validation, checkpoints, TensorBoard and the sampler, in its own process), runs interleaved
(b1 b2 b4 b1 b2 b4 ...), next to what the planner predicts. Every term of the plan but the baseline and
the weights is a batch-wide tensor, so the plan grows by the same bytes per sample at every batch; the
measured growth per sample says whether the runs do too.

None of these jobs is in the accuracy sweep (benchmarks/planner_accuracy.py) or the calibration.

    python benchmarks/planner_batch_scaling.py --job 128 128 96 16 --batches 1 2 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bigmem_train.config import Config, load_config
from bigmem_train.memory.calibrate import job_config, measure_run
from bigmem_train.memory.constants import load_calibration
from bigmem_train.memory.estimate import estimate

GIB = 2**30


def interleaved_runs(
    configs: dict[int, Config], key: str, repeats: int, workdir_name: str
) -> tuple[dict[int, dict[str, int]], list[dict]]:
    """Each config's plan, and ``repeats`` whole runs of every config, interleaved (A B A B ...): one row
    per run (``key``: the config's key, its peak, plan, step and the load before it), printed as it ends."""
    calibration = load_calibration()
    planned = {value: estimate(config, calibration) for value, config in configs.items()}
    workdir = Path(tempfile.gettempdir()) / workdir_name
    runs = []
    for repeat in range(repeats):
        for value, config in configs.items():
            load = os.getloadavg()[0]
            metrics = measure_run(config, workdir, "run")
            row = {
                key: value,
                "repeat": repeat,
                "peak_gib": round(metrics["peak_rss_bytes"] / GIB, 3),
                "file_backed_at_start_gib": round(metrics.get("file_backed_at_start_bytes", 0) / GIB, 3),
                "planned_gib": round(sum(planned[value].values()) / GIB, 3),
                "step_seconds": metrics.get("median_step_seconds"),
                "load_before": round(load, 2),
                "time": time.strftime("%H:%M:%S"),
            }
            runs.append(row)
            print(json.dumps(row), flush=True)
    return planned, runs


def write_results(path: Path, job: dict, planned: dict[int, dict[str, int]], runs: list[dict]) -> None:
    """The job, each config's planned breakdown (GiB) and every run, as JSON."""
    breakdown = {
        str(value): {part: round(size / GIB, 4) for part, size in parts.items()}
        for value, parts in planned.items()
    }
    path.write_text(json.dumps({"job": job, "planned_gib": breakdown, "runs": runs}, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", nargs=4, type=int, metavar=("X", "Y", "Z", "FILTERS"), required=True)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--channels", type=int, default=1, help="input channels")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    x, y, z, filters = args.job
    base = load_config()
    configs = {
        batch: job_config(
            base, shape=(x, y, z), batch=batch, filters=filters, depth=args.depth, channels=args.channels
        )
        for batch in args.batches
    }
    planned, runs = interleaved_runs(configs, "batch", args.runs, "bigmem-batch-scaling")
    print(f"\n{x}x{y}x{z} f{filters} d{args.depth} c{args.channels}")
    first = args.batches[0]
    low = [row["peak_gib"] for row in runs if row["batch"] == first]
    for batch in args.batches:
        peaks = [row["peak_gib"] for row in runs if row["batch"] == batch]
        plan = sum(planned[batch].values()) / GIB
        line = f"batch {batch}: peaks {', '.join(f'{p:.3f}' for p in peaks)} GiB, planned {plan:.3f}"
        if batch != first:
            per_sample = (min(peaks) - max(low)) / (batch - first), (max(peaks) - min(low)) / (batch - first)
            planned_per_sample = (plan - sum(planned[first].values()) / GIB) / (batch - first)
            line += (
                f"; per sample over batch {first}: measured {per_sample[0]:.3f}-{per_sample[1]:.3f} GiB, "
                f"planned {planned_per_sample:.3f}"
            )
        print(line)
    if args.json:
        job = {"shape": [x, y, z], "filters": filters, "depth": args.depth, "channels": args.channels}
        write_results(args.json, job, planned, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
