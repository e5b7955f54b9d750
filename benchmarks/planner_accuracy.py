"""Planner accuracy on whole runs: predicted vs measured peak resident memory of `bigmem-train train`.

Each job runs as a user runs it (``bigmem_train.memory.calibrate.measure_run``): `bigmem-train train` in
its own process, two epochs of two steps on a synthetic NIfTI dataset of the job's shape read through the
real pipeline, validation after each epoch, checkpoints, TensorBoard and the memory sampler, under the
runtime the launcher sets up (oneDNN, tcmalloc preloaded, threads). The planner predicts the same job
with the stored constants (``memory/calibration.json``, fitted by ``plan --calibrate`` on
``calibrate.CALIBRATION_JOBS`` and, where bf16 is native, ``MIXED_CALIBRATION_JOBS``, none of which
is in this sweep). Each job is measured at least twice and
judged on its worse run (the one the plan is furthest under, else furthest over).

Targets (issue 16), on the scored jobs: mean absolute error at most 3 %, worst at most 5 %, no job
under-predicted by more than 4 %; reported per size band (< 2 GiB, 2 to 8 GiB, 8 to 20 GiB).

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
import tempfile
import time
from pathlib import Path

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import cpu_isa, read_cpu_flags
from bigmem_train.memory.calibrate import CALIBRATION_JOBS, MIXED_CALIBRATION_JOBS, job_config, measure_run
from bigmem_train.memory.constants import Calibration, load_calibration
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
RESULTS = Path(__file__).resolve().parent / "results"


# A job judged on its worse run meets "at most 4 % under, at most 5 % over" under one plan P only if its
# runs a <= b satisfy b x 0.96 <= P <= a x 1.05, i.e. b / a <= 1.05 / 0.96 (docs/design/planner.md, Accuracy,
# "What the targets ask of a job whose runs part").
SPREAD_LIMIT = 1.05 / 0.96


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
    by_job: dict[str, list[dict]] = {}
    for record in read_results(results):
        by_job.setdefault(describe(record["job"]), []).append(record)
    if not by_job:
        raise SystemExit(f"no measurements in {results}; run without --predict-only first")
    rows = []
    for name, records in by_job.items():
        config = config_of(records[0]["job"])
        planned = sum(estimate(config, calibration).values())
        # What each run's plan.json said: the plan with the run's own file-backed part (mapped libraries,
        # measured once TensorFlow and the model were loaded) in place of the calibration's.
        predictions = [planned + file_backed_correction(calibration, r) for r in records]
        predicted = round(sum(predictions) / len(predictions))
        errors = [(p - r["peak_rss_bytes"]) / r["peak_rss_bytes"] for p, r in zip(predictions, records)]
        worst = min(errors) if min(errors) < 0 else max(errors)
        # The runs' peaks each at the calibration's file-backed part, as they are judged: how far they part.
        peaks = [r["peak_rss_bytes"] - file_backed_correction(calibration, r) for r in records]
        spread = max(peaks) / min(peaks)
        rows.append(
            {
                "job": name,
                "measured": [r["peak_rss_bytes"] for r in records],
                "predicted": predicted,
                "planned_before_start": planned,
                "errors": errors,
                "worst": worst,
                "spread": spread,
                "runs": len(records),
                "step_seconds": records[-1].get("median_step_seconds"),
            }
        )
    rows.sort(key=lambda row: row["predicted"])
    print(
        f"constants: {calibration.source}: baseline {calibration.runtime_baseline_bytes / 2**20:.0f} MiB, "
        f"activation factor {calibration.activation_factor}"
    )
    print("| job | measured GiB (runs) | predicted GiB | error per run | judged (worse run) | runs part by |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        measured = ", ".join(f"{m / GIB:.3f}" for m in row["measured"])
        errors = ", ".join(f"{e:+.1%}" for e in row["errors"])
        parting = f"{row['spread'] - 1:.1%}" + (" **" if row["spread"] > SPREAD_LIMIT else "")
        print(
            f"| {row['job']} | {measured} | {row['predicted'] / GIB:.3f} | {errors} | {row['worst']:+.1%} "
            f"| {parting} |"
        )
    summary = {}
    for name, low, high in [*BANDS, ("all", 0, float("inf"))]:
        band = [row for row in rows if low <= row["predicted"] < high]
        if not band:
            continue
        absolute = [abs(row["worst"]) for row in band]
        summary[name] = {
            "jobs": len(band),
            "mae": sum(absolute) / len(absolute),
            "worst": max(absolute),
            "most_under": min(min(row["worst"] for row in band), 0.0),
            "single_run_jobs": sum(1 for row in band if row["runs"] < 2),
        }
    print("\n| band | jobs | mean abs. error | worst | most under-predicted |")
    print("|---|---:|---:|---:|---:|")
    for name, figures in summary.items():
        print(
            f"| {name} | {figures['jobs']} | {figures['mae']:.1%} | {figures['worst']:.1%} | "
            f"{figures['most_under']:+.1%} |"
        )
    overall = summary["all"]
    met = overall["mae"] <= 0.03 and overall["worst"] <= 0.05 and overall["most_under"] >= -0.04
    print(
        f"\ntargets (MAE <= 3 %, worst <= 5 %, none under-predicted by more than 4 %): "
        f"{'met' if met else 'NOT met'} on {overall['jobs']} jobs"
        + (f" ({overall['single_run_jobs']} measured once so far)" if overall["single_run_jobs"] else "")
    )
    parting = [row["job"] for row in rows if row["spread"] > SPREAD_LIMIT]
    if parting:
        print(
            f"** runs of the same job part by more than {SPREAD_LIMIT - 1:.1%} (1.05 / 0.96): no one plan "
            f"meets both the 4 % and the 5 % target for them: {'; '.join(parting)}"
        )
    repo = Path(__file__).resolve().parents[1]
    source = calibration.source.replace(f"{repo}/", "")  # no machine paths in stored results
    return {
        "rows": rows,
        "summary": summary,
        "targets_met": met,
        "parting_past_targets": parting,
        "constants": source,
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
    parser.add_argument("--repeats", type=int, default=2, help="runs per job (judged on the worse)")
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
    axis.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="grey", alpha=0.2, label="within 10 %")
    for row in result["rows"]:
        for measured in row["measured"]:
            axis.scatter(measured / GIB, row["predicted"] / GIB, color="tab:blue", s=18)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("measured peak of a whole run (GiB)")
    axis.set_ylabel("planned peak (GiB)")
    summary = result["summary"]["all"]
    axis.set_title(
        f"planner on whole runs: {summary['jobs']} jobs, MAE {summary['mae']:.1%}, "
        f"worst {summary['worst']:.1%}"
    )
    axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
