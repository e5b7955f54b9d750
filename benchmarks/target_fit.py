"""How close a job sized with ``--target`` ends to its target (issue 46: within 8 % under it, never above).

Runs ``bigmem-train run --config study --target TARGET`` on synthetic 240x240x155 four-channel cases in the
Decathlon layout, as docs/results/study-job.md's "tile on a 24 GiB host" runs do: the run plans and sizes
itself (batch, crop, levers) under the target, trains, and judges itself. From the run directory this
records what the plan chose, the planned peak, the measured peak (RSS, as the verdict judges it), both against
the target and against each other, how far the peak climbed past the fourth step's, the step time and the
verdict, with the load average before and after.

    python benchmarks/target_fit.py --target 20GiB --out benchmarks/results/target_fit-20GiB-epyc.json

The run needs about the target in free memory and some 10 minutes on 2 cores; ``--keep DIR`` keeps its run
directory (default: a temporary folder, deleted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The peak after each step as the long-run benchmark reads it (memory.csv against steps.csv).
from long_run_growth import SHORT_STEPS, peaks_after_each_step

HERE = Path(__file__).resolve().parent
GIB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="20GiB")
    parser.add_argument(
        "--epochs", type=int, default=6, help="epochs of the study preset's steps (default 6)"
    )
    parser.add_argument("--cases", type=int, default=8, help="synthetic cases (default 8)")
    parser.add_argument("--keep", type=Path, help="run in this results folder and keep the run")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "target_fit-20GiB-epyc.json")
    args = parser.parse_args()

    folder = args.keep or Path(tempfile.mkdtemp(prefix="target-fit-"))
    folder.mkdir(parents=True, exist_ok=True)
    options = [
        "--target", args.target,
        "--set", "data.source=synthetic",
        "--set", f"data.synthetic_cases={args.cases}",
        "--set", "data.synthetic_shape=[240,240,155]",
        "--set", f"training.epochs={args.epochs}",
    ]  # fmt: skip
    command = ["bigmem-train", "run", "--config", "study", *options]
    run_name = f"target-fit-{time.strftime('%Y%m%d-%H%M%S')}"
    full = [
        sys.executable, "-m", "bigmem_train.cli", "run", "--config", "study", *options,
        "--set", f"output.results_dir={folder}", "--set", f"output.run_name={run_name}",
    ]  # fmt: skip
    load_before = os.getloadavg()
    started = time.monotonic()
    print(" ".join(command), flush=True)
    returncode = subprocess.run(full, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).returncode
    seconds = time.monotonic() - started
    load_after = os.getloadavg()
    run_dir = folder / run_name
    if not (run_dir / "plan.json").is_file():
        raise SystemExit(f"the run left no plan (exit {returncode}); see {run_dir}")
    plan = json.loads((run_dir / "plan.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    verdict = json.loads((run_dir / "verdict.json").read_text())
    target, planned, peak = plan["target_bytes"], plan["peak_bytes"], metrics["peak_measured_bytes"]
    steps = peaks_after_each_step(run_dir)
    short = steps[SHORT_STEPS - 1] if len(steps) >= SHORT_STEPS else None
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(command),
        "exit_code": returncode,
        "seconds": round(seconds, 1),
        "load_before": [round(value, 2) for value in load_before],
        "load_after": [round(value, 2) for value in load_after],
        "job": {
            key: plan.get(key)
            for key in ("batch_size", "input_shape", "precision", "recompute", "lever", "original_batch_size")
        },
        "target_bytes": target,
        "planned_bytes": planned,
        "peak_bytes": peak,
        "memory_measure": metrics.get("memory_measure"),
        "peak_after_each_step": steps,
        "climb_past_step_4": peak / short - 1 if short else None,
        "plan_under_target": 1 - planned / target,
        "peak_under_target": 1 - peak / target,
        "run_vs_plan": peak / planned - 1,
        "expected_range": plan.get("expected_range"),
        "median_step_seconds": metrics.get("median_step_seconds"),
        "steps": metrics.get("steps"),
        "verdict": verdict["verdict"],
        "criteria": {
            row["name"]: {"passed": row["passed"], "detail": row["detail"]} for row in verdict["criteria"]
        },
        "cpu": metrics.get("cpu_isa") or plan.get("calibration", "").rsplit("/", 1)[-1],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"target {target / GIB:.2f} GiB: batch {plan['batch_size']} at {plan['input_shape']}, planned "
        f"{planned / GIB:.2f} GiB ({result['plan_under_target']:.1%} under the target); peak {peak / GIB:.2f} GiB "
        f"({result['run_vs_plan']:+.1%} against the plan, {result['peak_under_target']:.1%} under the target); "
        f"verdict {verdict['verdict']}; {seconds / 60:.1f} min"
    )
    if not args.keep:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
