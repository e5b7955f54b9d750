"""What input channels cost a whole run: the same job with different channel counts, each a whole run as
the planner's sweep measures it (``measure_run``: `bigmem-train train`, two epochs of two steps with
validation, checkpoints, TensorBoard and the sampler, in its own process), runs interleaved
(c1 c4 c1 c4 ...), next to what the planner predicts and the input pipeline's share of it.

The channel count changes little of the model (the input tensor and the first convolution) and a lot of
the input pipeline's count (``estimate._input_pipeline_bytes``: every sample copy it counts is 4 B per voxel
and channel), so the measured cost of the extra channels against the planned one says whether that count
holds (docs/planner.md, Accuracy, "What three more channels cost").

None of these jobs is in the accuracy sweep (benchmarks/planner_accuracy.py) or the calibration.

    python benchmarks/planner_channels.py --job 160 160 96 1 16 --channels 1 4 --runs 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bigmem_train.config import load_config
from bigmem_train.memory.calibrate import job_config, measure_run
from bigmem_train.memory.constants import load_calibration
from bigmem_train.memory.estimate import estimate

GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--job", nargs=5, type=int, metavar=("X", "Y", "Z", "BATCH", "FILTERS"), required=True
    )
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--channels", nargs="+", type=int, default=[1, 4], choices=[1, 2, 3, 4])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    x, y, z, batch, filters = args.job
    base, calibration = load_config(), load_calibration()
    configs = {
        channels: job_config(
            base, shape=(x, y, z), batch=batch, filters=filters, depth=args.depth, channels=channels
        )
        for channels in args.channels
    }
    planned = {channels: estimate(config, calibration) for channels, config in configs.items()}
    workdir = Path(tempfile.gettempdir()) / "bigmem-channels"
    runs = []
    for repeat in range(args.runs):
        for channels, config in configs.items():
            load = os.getloadavg()[0]
            metrics = measure_run(config, workdir, "run")
            row = {
                "channels": channels,
                "repeat": repeat,
                "peak_gib": round(metrics["peak_rss_bytes"] / GIB, 3),
                "file_backed_at_start_gib": round(metrics.get("file_backed_at_start_bytes", 0) / GIB, 3),
                "planned_gib": round(sum(planned[channels].values()) / GIB, 3),
                "step_seconds": metrics.get("median_step_seconds"),
                "load_before": round(load, 2),
                "time": time.strftime("%H:%M:%S"),
            }
            runs.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{x}x{y}x{z} b{batch} f{filters} d{args.depth}")
    mean = {c: statistics.mean(r["peak_gib"] for r in runs if r["channels"] == c) for c in args.channels}
    first = args.channels[0]
    for channels in args.channels:
        peaks = ", ".join(f"{r['peak_gib']:.3f}" for r in runs if r["channels"] == channels)
        plan = sum(planned[channels].values()) / GIB
        pipeline = planned[channels]["input_pipeline"] / GIB
        line = f"{channels} channels: peaks {peaks} GiB, planned {plan:.3f} (input pipeline {pipeline:.3f})"
        if channels != first:
            planned_cost = plan - sum(planned[first].values()) / GIB
            line += (
                f"; over {first} channel(s): measured {mean[channels] - mean[first]:+.3f} GiB (means), "
                f"planned {planned_cost:+.3f}"
            )
        print(line)
    if args.json:
        breakdown = {
            str(channels): {key: round(value / GIB, 4) for key, value in parts.items()}
            for channels, parts in planned.items()
        }
        job = {"shape": [x, y, z], "batch": batch, "filters": filters, "depth": args.depth}
        args.json.write_text(
            json.dumps({"job": job, "planned_gib": breakdown, "runs": runs}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
