"""Planner accuracy on whole runs: predicted vs measured peak resident memory of `bigmem-train train`.

Each job runs as a user runs it (``bigmem_train.memory.calibrate.measure_run``): `bigmem-train train` in
its own process, two epochs of two steps on a synthetic NIfTI dataset of the job's shape read through the
real pipeline, validation after each epoch, checkpoints, TensorBoard and the memory sampler, under the
runtime the launcher sets up (oneDNN, tcmalloc preloaded, threads). The planner predicts the same job
with the stored constants (``memory/calibration.json``, fitted by ``plan --calibrate`` on
``calibrate.CALIBRATION_JOBS`` and, where bf16 is native, ``MIXED_CALIBRATION_JOBS``, none of which
is in this sweep). Each job is measured at least three times, each run in its own process.

The plan is the upper envelope of a job's runs (``constants.PLAN_COVERAGE``, ``PLAN_COST_BOUND``), and is
scored that way, per size band (< 2 GiB, 2 to 8 GiB, 8 to 20 GiB):
- coverage: no run ends above its plan by more than 3 %;
- cost: the plan is above the job's mean run by at most 4 % at the median over jobs and 12 % at worst.

    python benchmarks/planner_accuracy.py                       # measure what is missing, then report
    python benchmarks/planner_accuracy.py --max-gib 8           # only jobs predicted under 8 GiB
    python benchmarks/planner_accuracy.py --predict-only        # re-predict stored measurements
    python benchmarks/planner_accuracy.py --json results.json   # also write the table as JSON

Measurements go to ``benchmarks/results/planner_accuracy-CPU.jsonl`` (CPU: ``host.cpu_isa``, e.g.
``avx512+amx``), one file per class of CPU, since the constants are fitted per class.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import cpu_isa, read_cpu_flags
from bigmem_train.memory.calibrate import CALIBRATION_JOBS, MIXED_CALIBRATION_JOBS, job_config, measure_run
from bigmem_train.memory.constants import (
    PLAN_COST_BOUND,
    PLAN_COVERAGE,
    Calibration,
    load_calibration,
    run_kind,
)
from bigmem_train.memory.estimate import estimate

GIB = 2**30
# Edges 48..240 incl. non-cubic, batch 1..8, base filters 8..32, depth 3..5, 1 and 4 channels, binary and
# multiclass, gradient recomputation on and off, mixed_bfloat16; predicted peaks from 0.8 to 20 GiB.
# None of them is a calibration job (checked below).
SWEEP: list[dict] = [
    # < 2 GiB
    {"shape": (48, 48, 48), "batch": 2, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (96, 64, 48), "batch": 1, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (64, 64, 64), "batch": 1, "filters": 16, "depth": 5, "channels": 4},
    {"shape": (80, 80, 48), "batch": 3, "filters": 8, "depth": 4, "channels": 1, "classes": 4},
    {"shape": (64, 64, 32), "batch": 1, "filters": 32, "depth": 3, "channels": 1},
    {"shape": (96, 96, 64), "batch": 2, "filters": 8, "depth": 4, "channels": 4, "recompute": True},
    {
        "shape": (64, 64, 48),
        "batch": 2,
        "filters": 8,
        "depth": 3,
        "channels": 1,
        "precision": "mixed_bfloat16",
    },
    {"shape": (128, 96, 64), "batch": 1, "filters": 8, "depth": 4, "channels": 1},
    # 2 to 8 GiB
    {"shape": (128, 128, 96), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (160, 152, 104), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (128, 96, 96), "batch": 1, "filters": 16, "depth": 4, "channels": 4, "classes": 4},
    {"shape": (96, 96, 96), "batch": 4, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (128, 128, 128), "batch": 2, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (192, 192, 128), "batch": 1, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (144, 144, 96), "batch": 2, "filters": 8, "depth": 4, "channels": 4},
    {"shape": (96, 96, 64), "batch": 8, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (160, 160, 112), "batch": 2, "filters": 16, "depth": 4, "channels": 1, "recompute": True},
    {"shape": (240, 240, 144), "batch": 1, "filters": 8, "depth": 4, "channels": 1, "recompute": True},
    # 8 to 20 GiB: the study's tile (240x240x144, FLAIR, 16 filters, 4 poolings) and its neighbours
    {"shape": (240, 240, 144), "batch": 1, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (240, 240, 144), "batch": 2, "filters": 16, "depth": 4, "channels": 1, "recompute": True},
    {"shape": (240, 240, 144), "batch": 1, "filters": 16, "depth": 4, "channels": 4, "classes": 4},
    {"shape": (192, 192, 128), "batch": 2, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (240, 208, 144), "batch": 1, "filters": 24, "depth": 4, "channels": 1},
    {"shape": (224, 224, 160), "batch": 1, "filters": 16, "depth": 5, "channels": 1},
    {"shape": (160, 160, 128), "batch": 4, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (176, 176, 128), "batch": 3, "filters": 16, "depth": 4, "channels": 4},
]
BANDS = [("< 2 GiB", 0, 2 * GIB), ("2 to 8 GiB", 2 * GIB, 8 * GIB), ("8 to 20 GiB", 8 * GIB, 21 * GIB)]
KINDS = ("plain", "recompute", "mixed")
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_kind() -> str:
    """The oneDNN ISA class of this CPU (``host.cpu_isa``), which decides the convolution kernels and so
    part of the peak; results from different CPUs are kept in different files."""
    return cpu_isa(read_cpu_flags())


def describe(job: dict) -> str:
    text = f"{'x'.join(map(str, job['shape']))} b{job['batch']} f{job['filters']} d{job['depth']} c{job['channels']}"
    if job.get("classes", 1) > 1:
        text += f" k{job['classes']}"
    if job.get("recompute"):
        text += " recompute"
    if job.get("precision", "float32") != "float32":
        text += " bf16"
    return text


def config_of(job: dict):
    return job_config(load_config(), **{**job, "shape": tuple(job["shape"])})


def read_results(results: Path) -> list[dict]:
    if not results.exists():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def measure(results: Path, repeats: int, max_bytes: float, only: list[int] | None) -> None:
    calibration = load_calibration()
    counts: dict[str, int] = {}
    for record in read_results(results):
        counts[describe(record["job"])] = counts.get(describe(record["job"]), 0) + 1
    workdir = Path(os.environ.get("BIGMEM_ACCURACY_WORKDIR") or tempfile.gettempdir()) / "bigmem-accuracy"
    for repeat in range(repeats):
        for index, job in enumerate(SWEEP):
            if (only and index not in only) or counts.get(describe(job), 0) > repeat:
                continue
            config = config_of(job)
            predicted = sum(estimate(config, calibration).values())
            if predicted > max_bytes:
                continue
            load = os.getloadavg()[0]
            try:
                metrics = measure_run(config, workdir, f"sweep-{index}")
            except BadInput as error:  # one job that cannot run here (memory, a killed child) stops no other
                print(f"[{index}] {describe(job)}: not measured: {error}", flush=True)
                continue
            record = {
                "job": {**job, "shape": list(job["shape"])},
                "peak_rss_bytes": metrics["peak_rss_bytes"],
                "file_backed_at_peak_bytes": metrics.get("file_backed_at_peak_bytes"),
                "file_backed_at_start_bytes": metrics.get("file_backed_at_start_bytes"),
                "median_step_seconds": metrics.get("median_step_seconds"),
                "wall_seconds": metrics["wall_seconds"],
                "load_before": round(load, 2),
                "load_after": round(os.getloadavg()[0], 2),
                "cpu": cpu_kind(),
                "date": time.strftime("%Y-%m-%d"),
                "host": platform.node(),
            }
            with results.open("a") as stream:
                stream.write(json.dumps(record) + "\n")
            counts[describe(job)] = counts.get(describe(job), 0) + 1
            print(
                f"[{index}] {describe(job)}: peak {metrics['peak_rss_bytes'] / GIB:.3f} GiB, predicted "
                f"{predicted / GIB:.3f} GiB, {metrics['wall_seconds']} s (load {load:.1f})",
                flush=True,
            )


def file_backed_correction(calibration: Calibration, record: dict) -> int:
    """The run's file-backed RSS at its start minus the calibration's (``JobPlan.with_file_backed``), or 0
    where either is unknown."""
    measured = record.get("file_backed_at_start_bytes")
    if not measured or calibration.file_backed_bytes is None:
        return 0
    return measured - calibration.file_backed_bytes


def report(results: Path, calibration: Calibration) -> dict:
    """Score the stored runs against today's plans: the plan is the upper envelope of a job's runs
    (constants.PLAN_COVERAGE / PLAN_COST_BOUND): coverage (how far any run ends above its plan) and cost
    (how far the plan is above the job's mean run), per job and per size band."""
    by_job: dict[str, list[dict]] = {}
    for record in read_results(results):
        by_job.setdefault(describe(record["job"]), []).append(record)
    if not by_job:
        raise SystemExit(f"no measurements in {results}; run without --predict-only first")
    rows = []
    for name, records in by_job.items():
        config = config_of(records[0]["job"])
        planned = sum(estimate(config, calibration).values())
        # Each run at the calibration's file-backed part (mapped libraries, which a run measures for itself
        # and its plan.json trades in, JobPlan.with_file_backed): what the plan is judged against.
        peaks = [r["peak_rss_bytes"] - file_backed_correction(calibration, r) for r in records]
        mean = sum(peaks) / len(peaks)
        rows.append(
            {
                "job": name,
                "measured": [r["peak_rss_bytes"] for r in records],
                "judged": peaks,
                "predicted": planned,
                "over": max(peaks) / planned - 1,
                "cost": planned / mean - 1,
                "spread": max(peaks) / min(peaks) - 1,
                "runs": len(records),
                "kind": run_kind(config),
                "dates": sorted({r.get("date", "") for r in records}),
                "step_seconds": records[-1].get("median_step_seconds"),
            }
        )
    rows.sort(key=lambda row: row["predicted"])
    print(
        f"constants: {calibration.source}: baseline {calibration.runtime_baseline_bytes / 2**20:.0f} MiB, "
        f"activation factor {calibration.activation_factor}, envelope margins "
        + (
            ", ".join(f"{kind} {margin:.2%}" for kind, margin in calibration.envelope_margins.items())
            or f"{calibration.envelope_margin:.2%}"
        )
    )
    print("| job | runs (GiB) | plan GiB | worst run vs plan | plan vs mean run | runs part by |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        runs = ", ".join(f"{m / GIB:.3f}" for m in row["judged"])
        flag = " **" if row["over"] > PLAN_COVERAGE else ""
        print(
            f"| {row['job']} | {runs} | {row['predicted'] / GIB:.3f} | {row['over']:+.1%}{flag} "
            f"| {row['cost']:+.1%} | {row['spread']:.1%} |"
        )
    summary = {}
    # Per size band, then per kind of job (constants.run_kind: each has its own envelope margin).
    groups = [
        (name, [row for row in rows if low <= row["predicted"] < high])
        for name, low, high in [*BANDS, ("all", 0, float("inf"))]
    ] + [(f"kind: {kind}", [row for row in rows if row["kind"] == kind]) for kind in KINDS]
    for name, band in groups:
        if not band:
            continue
        costs = sorted(row["cost"] for row in band)
        summary[name] = {
            "jobs": len(band),
            "runs": sum(row["runs"] for row in band),
            "runs_over_coverage": sum(
                1 for row in band for peak in row["judged"] if peak > row["predicted"] * (1 + PLAN_COVERAGE)
            ),
            "worst_over": max(row["over"] for row in band),
            "cost_median": statistics.median(costs),
            "cost_worst": max(costs),
            "jobs_with_fewer_than_3_runs": sum(1 for row in band if row["runs"] < 3),
        }
    print("\n| band | jobs | runs | runs > 3 % over plan | worst run vs plan | cost: median | cost: worst |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, figures in summary.items():
        print(
            f"| {name} | {figures['jobs']} | {figures['runs']} | {figures['runs_over_coverage']} | "
            f"{figures['worst_over']:+.1%} | {figures['cost_median']:+.1%} | {figures['cost_worst']:+.1%} |"
        )
    overall = summary["all"]
    coverage_met = overall["runs_over_coverage"] == 0
    cost_met = overall["cost_median"] <= 0.04 and overall["cost_worst"] <= PLAN_COST_BOUND
    print(
        f"\ncoverage (no run more than {PLAN_COVERAGE:.0%} above its plan): {'met' if coverage_met else 'NOT met'}; "
        f"cost (plan above the mean run by at most 4 % at the median, {PLAN_COST_BOUND:.0%} at worst): "
        f"{'met' if cost_met else 'NOT met'}; {overall['jobs']} jobs, {overall['runs']} runs"
        + (
            f" ({overall['jobs_with_fewer_than_3_runs']} jobs with fewer than 3 runs)"
            if overall["jobs_with_fewer_than_3_runs"]
            else ""
        )
    )
    repo = Path(__file__).resolve().parents[1]
    source = calibration.source.replace(f"{repo}/", "")  # no machine paths in stored results
    return {
        "rows": rows,
        "summary": summary,
        "coverage_met": coverage_met,
        "cost_met": cost_met,
        "constants": source,
        "envelope_margin": calibration.envelope_margin,
        "envelope_margins": calibration.envelope_margins,
        "run_range": calibration.run_range,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="measurements (JSON lines); default results/planner_accuracy-CPU.jsonl for this CPU's class",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per job (the plan is their envelope)")
    parser.add_argument("--max-gib", type=float, default=20.0, help="skip jobs predicted above this")
    parser.add_argument(
        "--only", type=int, action="append", help="measure only this sweep index (repeatable)"
    )
    parser.add_argument("--predict-only", action="store_true", help="only re-predict stored measurements")
    parser.add_argument("--json", type=Path, help="also write the table and summary here")
    args = parser.parse_args()
    args.results = args.results or RESULTS / f"planner_accuracy-{cpu_kind()}.jsonl"
    calibration_jobs = {
        describe({**job, "shape": list(job["shape"])}) for job in CALIBRATION_JOBS + MIXED_CALIBRATION_JOBS
    }
    overlap = [describe(job) for job in SWEEP if describe(job) in calibration_jobs]
    if overlap:
        raise SystemExit(f"sweep jobs that are also calibration jobs: {overlap}")
    if not args.predict_only:
        measure(args.results, args.repeats, args.max_gib * GIB, args.only)
    result = report(args.results, load_calibration())
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, args.json.with_suffix(".png"))
    return 0


def plot(result: dict, path: Path) -> None:
    """Predicted against measured peak per job (every run), with the tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 6))
    top = max(max(row["measured"]) for row in result["rows"]) / GIB * 1.15
    axis.plot([0, top], [0, top], color="black", linewidth=1, label="planned = measured")
    axis.fill_between(
        [0, top],
        [0, top / (1 + PLAN_COVERAGE)],
        [0, top * (1 + PLAN_COST_BOUND)],
        color="grey",
        alpha=0.2,
        label=f"run at most {PLAN_COVERAGE:.0%} above, plan at most {PLAN_COST_BOUND:.0%} above",
    )
    for row in result["rows"]:
        for measured in row["judged"]:
            over = measured > row["predicted"] * (1 + PLAN_COVERAGE)
            axis.scatter(
                measured / GIB, row["predicted"] / GIB, color="tab:red" if over else "tab:blue", s=18
            )
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("measured peak of a whole run (GiB)")
    axis.set_ylabel("planned peak (GiB)")
    summary = result["summary"]["all"]
    axis.set_title(
        f"plan as envelope: {summary['jobs']} jobs, {summary['runs']} runs, "
        f"{summary['runs_over_coverage']} over coverage, cost median {summary['cost_median']:+.1%}"
    )
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
