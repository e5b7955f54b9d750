"""How far a longer run's peak resident memory climbs past the short whole runs the planner is fitted on.

The planner's constants are fitted, and its envelope scored, on whole runs of two epochs of two steps
(``calibrate.WHOLE_RUN_EPOCHS``, ``WHOLE_RUN_STEPS``: benchmarks/planner_accuracy.py). A user's run takes
thousands of steps. This benchmark runs sweep jobs the same way but for ``--epochs`` epochs of two steps,
records the peak after every training step (memory.csv against steps.csv), and prints the peak after the
short run's four steps, the long run's peak, and both against today's plan, so that what a long run adds is
a measured figure, not an assumption.

    python benchmarks/long_run_growth.py --job "128x128x128 b2 f8 d4 c1" --job "192x192x128 b2 f16 d4 c1"
    python benchmarks/long_run_growth.py --report-only

Measurements append to ``benchmarks/results/long_run_growth-CPU.jsonl`` (CPU: ``host.cpu_isa``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import time
from pathlib import Path

from planner_accuracy import RESULTS, SWEEP, config_of, cpu_kind, describe, file_backed_correction

from bigmem_train.memory.calibrate import WHOLE_RUN_EPOCHS, WHOLE_RUN_STEPS, measure_run
from bigmem_train.memory.constants import PLAN_COVERAGE, load_calibration
from bigmem_train.memory.estimate import estimate

GIB = 2**30
SHORT_STEPS = WHOLE_RUN_EPOCHS * WHOLE_RUN_STEPS


def peaks_after_each_step(run_dir: Path) -> list[int]:
    """The run's peak RSS up to the end of each training step (memory.csv against steps.csv)."""
    with (run_dir / "memory.csv").open() as stream:
        samples = [(float(row["time_unix"]), int(row["rss_bytes"])) for row in csv.DictReader(stream)]
    with (run_dir / "steps.csv").open() as stream:
        ends = [float(row["time_unix"]) for row in csv.DictReader(stream)]
    return [max((rss for at, rss in samples if at <= end), default=0) for end in ends]


def measure(results: Path, jobs: list[str], epochs: int) -> None:
    names = {describe(job): job for job in SWEEP}
    unknown = [name for name in jobs if name not in names]
    if unknown:
        raise SystemExit(f"not sweep jobs: {unknown} (names as planner_accuracy.py prints them)")
    workdir = Path(os.environ.get("BIGMEM_ACCURACY_WORKDIR") or tempfile.gettempdir()) / "bigmem-long-runs"
    for name in jobs:
        load = os.getloadavg()[0]
        run_name = name.replace(" ", "_")
        metrics = measure_run(config_of(names[name]), workdir, run_name, keep=True, epochs=epochs)
        record = {
            "job": {**names[name], "shape": list(names[name]["shape"])},
            "epochs": epochs,
            "steps_per_epoch": WHOLE_RUN_STEPS,
            "peak_rss_bytes": metrics["peak_rss_bytes"],
            "peak_after_step": peaks_after_each_step(workdir / run_name),
            "file_backed_at_start_bytes": metrics.get("file_backed_at_start_bytes"),
            "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "wall_seconds": metrics["wall_seconds"],
            "cpu": cpu_kind(),
            "date": time.strftime("%Y-%m-%d"),
        }
        with results.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        print(f"{name}: peak {metrics['peak_rss_bytes'] / GIB:.3f} GiB", flush=True)


def report(results: Path) -> list[dict]:
    calibration = load_calibration()
    rows = []
    print(
        f"| job | steps | peak after {SHORT_STEPS} steps | long run's peak | growth | plan | long run vs plan |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for line in results.read_text().splitlines():
        record = json.loads(line)
        correction = file_backed_correction(calibration, record)  # judged at the calibration's mapped part
        short = record["peak_after_step"][SHORT_STEPS - 1] - correction
        long = record["peak_rss_bytes"] - correction
        plan = sum(estimate(config_of(record["job"]), calibration).values())
        row = {
            "job": describe(record["job"]),
            "steps": len(record["peak_after_step"]),
            "short": short,
            "long": long,
            "growth": long / short - 1,
            "plan": plan,
            "over": long / plan - 1,
            # the step after which the peak no longer rose by more than 1 %
            "plateau_step": next(
                step + 1
                for step, peak in enumerate(record["peak_after_step"])
                if record["peak_rss_bytes"] <= peak * 1.01
            ),
        }
        rows.append(row)
        flag = " **" if row["over"] > PLAN_COVERAGE else ""
        print(
            f"| {row['job']} | {row['steps']} | {short / GIB:.3f} | {long / GIB:.3f} | {row['growth']:+.1%} "
            f"(plateau after step {row['plateau_step']}) | {plan / GIB:.3f} | {row['over']:+.1%}{flag} |"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", action="append", default=[], help="a sweep job by name (repeatable)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs of two steps (default 8: 16 steps)")
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()
    results = args.results or RESULTS / f"long_run_growth-{cpu_kind()}.jsonl"
    if not args.report_only:
        measure(results, args.job, args.epochs)
    rows = report(results)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
