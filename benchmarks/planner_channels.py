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
import statistics
from pathlib import Path

from planner_batch_scaling import GIB, interleaved_runs, write_results

from bigmem_train.config import load_config
from bigmem_train.memory.calibrate import job_config


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
    base = load_config()
    configs = {
        channels: job_config(
            base, shape=(x, y, z), batch=batch, filters=filters, depth=args.depth, channels=channels
        )
        for channels in args.channels
    }
    planned, runs = interleaved_runs(configs, "channels", args.runs, "bigmem-channels")
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
        job = {"shape": [x, y, z], "batch": batch, "filters": filters, "depth": args.depth}
        write_results(args.json, job, planned, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
