"""How far a longer run's peak resident memory climbs past the short whole runs the planner is fitted on.

The planner's constants are fitted, and its envelope scored, on whole runs of two epochs of two steps
(``calibrate.WHOLE_RUN_EPOCHS``, ``WHOLE_RUN_STEPS``: benchmarks/planner_accuracy.py). A user's run takes
thousands of steps. This benchmark runs sweep jobs the same way but for ``--epochs`` epochs of two steps,
records the peak after every training step (memory.csv against steps.csv), and prints the peak after the
short run's four steps, the long run's peak, and both against today's plan, so that what a long run adds is
a measured figure, not an assumption.

    python benchmarks/long_run_growth.py --job "128x128x128 b2 f8 d4 c1" --job "192x192x128 b2 f16 d4 c1"
    python benchmarks/long_run_growth.py --plain-jobs --max-gib 6 --results results/planner_accuracy-long-CPU.jsonl
    python benchmarks/long_run_growth.py --report-only

``--plain-jobs`` runs every plain calibration job (they fit the long-run allowance:
``python -m bigmem_train.memory.calibrate --refit ... --add-long``) and every plain sweep job (held out, they
score it) planned under ``--max-gib``; each record says which set it is of.

Measurements append to ``benchmarks/results/long_run_growth-CPU.jsonl`` (CPU: ``host.cpu_isa``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from planner_accuracy import RESULTS, SWEEP, config_of, cpu_kind, describe, file_backed_correction

from bigmem_train.memory.calibrate import CALIBRATION_JOBS, WHOLE_RUN_EPOCHS, WHOLE_RUN_STEPS, measure_run
from bigmem_train.memory.constants import PLAN_COVERAGE, load_calibration, run_kind
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


def plain_jobs(jobs: list[dict], max_bytes: float) -> list[str]:
    """The plain jobs (``run_kind``) of ``jobs`` planned at most ``max_bytes``, smallest plan first."""
    calibration = load_calibration()
    planned = {describe(job): sum(estimate(config_of(job), calibration).values()) for job in jobs}
    plain = [describe(job) for job in jobs if run_kind(config_of(job)) == "plain"]
    return sorted((name for name in plain if planned[name] <= max_bytes), key=planned.get)


def interleave(first: list[str], second: list[str]) -> list[str]:
    """One of each in turn, so that a run cut short still has jobs of both sets."""
    merged = []
    for index in range(max(len(first), len(second))):
        merged += first[index : index + 1] + second[index : index + 1]
    return merged


def measure(results: Path, jobs: list[str], epochs: int) -> None:
    names = {describe(job): job for job in SWEEP + CALIBRATION_JOBS}
    calibration_names = {describe(job) for job in CALIBRATION_JOBS}
    unknown = [name for name in jobs if name not in names]
    if unknown:
        raise SystemExit(
            f"not sweep or calibration jobs: {unknown} (names as planner_accuracy.py prints them)"
        )
    workdir = Path(os.environ.get("BIGMEM_ACCURACY_WORKDIR") or tempfile.gettempdir()) / "bigmem-long-runs"
    for name in jobs:
        load = os.getloadavg()[0]
        run_name = name.replace(" ", "_")
        metrics = measure_run(config_of(names[name]), workdir, run_name, keep=True, epochs=epochs)
        record = {
            "job": {**names[name], "shape": list(names[name]["shape"])},
            # calibration jobs fit the constants; sweep jobs are held out of the fit and score it
            "set": "calibration" if name in calibration_names else "held-out",
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


def report(results: list[Path]) -> dict:
    """Each stored long run against today's plan, and per set (calibration jobs, held-out sweep jobs) and
    kind: coverage (how far a run ends above its plan) and cost (how far the plan is above the run)."""
    calibration = load_calibration()
    rows = []
    print(
        f"| job | set | steps | peak after {SHORT_STEPS} steps | long run's peak | growth | plan | "
        "long run vs plan | cost |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    records = [json.loads(line) for path in results for line in path.read_text().splitlines() if line.strip()]
    for record in records:
        correction = file_backed_correction(calibration, record)  # judged at the calibration's mapped part
        short = record["peak_after_step"][SHORT_STEPS - 1] - correction
        long = record["peak_rss_bytes"] - correction
        config = config_of(record["job"])
        plan = sum(estimate(config, calibration).values())
        row = {
            "job": describe(record["job"]),
            # the first long runs (before --plain-jobs) were all of sweep jobs
            "set": record.get("set", "held-out"),
            "kind": run_kind(config),
            "steps": len(record["peak_after_step"]),
            "short": short,
            "long": long,
            "growth": long / short - 1,
            "plan": plan,
            "over": long / plan - 1,
            "cost": plan / long - 1,
            # the step after which the peak no longer rose by more than 1 %
            "plateau_step": next(
                step + 1
                for step, peak in enumerate(record["peak_after_step"])
                if record["peak_rss_bytes"] <= peak * 1.01
            ),
            "load": [record.get("load_before"), record.get("load_after")],
        }
        rows.append(row)
        flag = " **" if row["over"] > PLAN_COVERAGE else ""
        print(
            f"| {row['job']} | {row['set']} | {row['steps']} | {short / GIB:.3f} | {long / GIB:.3f} | "
            f"{row['growth']:+.1%} (plateau after step {row['plateau_step']}) | {plan / GIB:.3f} | "
            f"{row['over']:+.1%}{flag} | {row['cost']:.1%} |"
        )
    summary = {}
    for group in sorted({(row["set"], row["kind"]) for row in rows}):
        members = [row for row in rows if (row["set"], row["kind"]) == group]
        costs = [row["cost"] for row in members]
        summary[f"{group[0]}: {group[1]}"] = {
            "runs": len(members),
            "runs_over_coverage": sum(1 for row in members if row["over"] > PLAN_COVERAGE),
            "highest_over": max(row["over"] for row in members),
            "lowest_over": min(row["over"] for row in members),
            "cost_median": statistics.median(costs),
            "cost_worst": max(costs),
        }
    print("\n| set: kind | runs | runs > 3 % above plan | runs vs plan | cost: median | cost: worst |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, figures in summary.items():
        print(
            f"| {name} | {figures['runs']} | {figures['runs_over_coverage']} | {figures['lowest_over']:+.1%} "
            f"to {figures['highest_over']:+.1%} | {figures['cost_median']:.1%} | {figures['cost_worst']:.1%} |"
        )
    repo = Path(__file__).resolve().parents[1]
    return {
        "constants": calibration.source.replace(f"{repo}/", ""),
        "long_run_growth": calibration.long_run_growth,
        "envelope_margins": calibration.envelope_margins,
        "rows": rows,
        "summary": summary,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", action="append", default=[], help="a sweep job by name (repeatable)")
    parser.add_argument(
        "--plain-jobs",
        action="store_true",
        help="every plain calibration and sweep job planned under --max-gib, one of each set in turn",
    )
    parser.add_argument("--max-gib", type=float, default=6.0, help="with --plain-jobs: skip larger plans")
    parser.add_argument("--epochs", type=int, default=8, help="epochs of two steps (default 8: 16 steps)")
    parser.add_argument(
        "--results",
        type=Path,
        action="append",
        default=[],
        help="where runs are stored (the first) and read from (repeatable; default long_run_growth-CPU.jsonl)",
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    args = parser.parse_args()
    results = args.results or [RESULTS / f"long_run_growth-{cpu_kind()}.jsonl"]
    jobs = list(args.job)
    if args.plain_jobs:
        limit = args.max_gib * GIB
        jobs += interleave(plain_jobs(CALIBRATION_JOBS, limit), plain_jobs(SWEEP, limit))
    if not args.report_only:
        measure(results[0], jobs, args.epochs)
    result = report(results)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
