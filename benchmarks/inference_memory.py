"""Inference memory: the planner's forward-only peak against whole `bigmem-train predict` processes.

Each job (a U-Net and a volume shape, whole or in tiles) runs `bigmem-train predict` on one synthetic
NIfTI volume in a fresh process with an untrained model of that configuration (weights do not change the
memory), and compares the process's peak resident set (VmHWM, as predict.json records it) with the plan
recorded in predict.json.
``--fit`` refits the two constants of memory/inference.py (runtime baseline, forward factor) by least
squares on the jobs marked ``fit`` and reports the error on every job, the held-out ones apart.

    python benchmarks/inference_memory.py            # ~5 min on 2 cores
    python benchmarks/inference_memory.py --fit

Writes benchmarks/results/inference_memory.jsonl (one line per job).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "inference_memory.jsonl"

# name, model settings, channels in the image, job's data.channels, volume shape, --tile, fit or held out
JOBS = [
    ("d3-f8-64x64x40", {"depth": 3, "base_filters": 8}, 4, [0], (64, 64, 40), None, True),
    ("d3-f8-128x128x96", {"depth": 3, "base_filters": 8}, 4, [0], (128, 128, 96), None, False),
    ("d4-f16-160x160x128", {"depth": 4, "base_filters": 16}, 4, [0], (160, 160, 128), None, True),
    ("d4-f16-240x240x155", {"depth": 4, "base_filters": 16}, 4, [0], (240, 240, 155), None, False),
    ("d4-f8-240x240x155", {"depth": 4, "base_filters": 8}, 4, [0], (240, 240, 155), None, True),
    (
        "d4-f16-c4-k4-192x192x128",
        {"depth": 4, "base_filters": 16, "output_classes": 4},
        4,
        "all",
        (192, 192, 128),
        None,
        False,
    ),
    (
        "d4-f16-240x240x155-tiles-128",
        {"depth": 4, "base_filters": 16},
        4,
        [0],
        (240, 240, 155),
        (128, 128, 128),
        True,
    ),
    (
        "d3-f16-200x200x120-tiles-96",
        {"depth": 3, "base_filters": 16},
        1,
        [0],
        (200, 200, 120),
        (96, 96, 96),
        False,
    ),
]


def run_job(job, workdir: Path, engine: str) -> dict:
    name, model, image_channels, channels, shape, tile, fit = job
    folder = workdir / f"{name}-{engine}"
    folder.mkdir()
    multiclass = model.get("output_classes", 1) > 1
    config = {
        "data": {
            "channels": channels,
            "label_mode": "multiclass" if multiclass else "binary",
            "input_shape": [2 ** model["depth"] * 2] * 3,
        },
        "model": model,
    }
    import yaml

    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    script = f"""
import sys, yaml
sys.argv = ["x"]
from bigmem_train.config import load_config
from bigmem_train.model.unet import build_unet
config = load_config({str(folder / "config.yaml")!r})
model = build_unet(config.model, tuple(config.data.input_shape), config.num_channels)
import pathlib; pathlib.Path({str(folder / "checkpoints")!r}).mkdir()
model.save({str(folder / "checkpoints" / "best.keras")!r})
"""
    subprocess.run(
        [sys.executable, "-c", script], check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    )
    import nibabel as nib

    rng = np.random.default_rng(0)
    data = rng.integers(0, 1000, size=(*shape, image_channels), dtype=np.int16)
    data = data[..., 0] if image_channels == 1 else data
    nib.save(nib.Nifti1Image(data, np.eye(4)), folder / "case.nii.gz")
    command = [
        sys.executable,
        "-m",
        "bigmem_train.cli",
        "predict",
        "--model",
        str(folder),
        "--data",
        str(folder / "case.nii.gz"),
        "--out",
        str(folder / "out"),
    ]
    command += ["--engine", engine]
    if tile:
        command += ["--tile", ",".join(map(str, tile))]
    subprocess.run(command, check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, capture_output=True)
    case = json.loads((folder / "out" / "predict.json").read_text())["cases"]["case"]
    plan = case["plan"]
    return {
        "job": name,
        "engine": engine,
        "fit": fit,
        "mode": plan["mode"],
        "window": plan["window"],
        "tiles": plan["tiles"],
        "measured_peak_bytes": case["peak_rss_bytes"],
        "planned_peak_bytes": case["planned_peak_bytes"],
        "breakdown": plan["breakdown"],
        "forward_live_bytes": plan["forward_live_bytes"],
        "seconds": case["seconds"],
        "load": os.getloadavg()[0],
    }


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares: measured - (numpy volumes + parameters) = baseline + factor * forward live set."""
    chosen = [row for row in rows if row["fit"]]
    if not chosen:
        return 0.0, 0.0
    fixed = np.array(
        [
            sum(v for k, v in row["breakdown"].items() if k not in {"forward_pass", "runtime_baseline"})
            for row in chosen
        ]
    )
    measured = np.array([row["measured_peak_bytes"] for row in chosen], dtype=float)
    live = np.array([row["forward_live_bytes"] for row in chosen], dtype=float)
    matrix = np.vstack([np.ones_like(live), live]).T
    (baseline, factor), *_ = np.linalg.lstsq(matrix, measured - fixed, rcond=None)
    return float(baseline), float(factor)


def envelope(rows: list[dict]) -> tuple[float, float]:
    """The upper envelope over every job: for each factor the smallest baseline that leaves no job above
    its plan, then the factor whose plans exceed the measured peaks least on average."""
    fixed = np.array(
        [
            sum(v for k, v in row["breakdown"].items() if k not in {"forward_pass", "runtime_baseline"})
            for row in rows
        ]
    )
    measured = np.array([row["measured_peak_bytes"] for row in rows], dtype=float)
    live = np.array([row["forward_live_bytes"] for row in rows], dtype=float)
    best = None
    for factor in np.arange(0.5, 3.0, 0.005):
        baseline = float(np.max(measured - fixed - factor * live))
        cost = float(np.mean((fixed + baseline + factor * live) / measured - 1))
        if best is None or cost < best[0]:
            best = (cost, baseline, float(factor))
    return best[1], best[2]


def report(rows: list[dict], baseline: float | None = None, factor: float | None = None) -> None:
    print(f"{'job':34} {'engine':10} {'mode':6} {'planned GiB':>11} {'measured GiB':>12} {'error':>7}  set")
    for row in rows:
        planned = row["planned_peak_bytes"]
        if baseline is not None:
            fixed = sum(
                v for k, v in row["breakdown"].items() if k not in {"forward_pass", "runtime_baseline"}
            )
            planned = fixed + baseline + factor * row["forward_live_bytes"]
        error = planned / row["measured_peak_bytes"] - 1
        print(
            f"{row['job']:34} {row['mode']:6} {planned / 2**30:11.2f} {row['measured_peak_bytes'] / 2**30:12.2f} "
            f"{error:+7.1%}  {'fit' if row['fit'] else 'held out'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fit",
        action="store_true",
        help="fit the constants (least squares on the fit set; the envelope on all)",
    )
    parser.add_argument("--reuse", action="store_true", help="use the recorded results instead of running")
    parser.add_argument("--engines", nargs="+", default=["tensorflow", "openvino"])
    args = parser.parse_args()
    if args.reuse:
        rows = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    else:
        rows = []
        with tempfile.TemporaryDirectory() as workdir:
            for job in JOBS:
                for engine in args.engines:
                    rows.append(run_job(job, Path(workdir), engine))
                print(
                    f"{rows[-1]['job']}: measured {rows[-1]['measured_peak_bytes'] / 2**30:.2f} GiB",
                    flush=True,
                )
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report(rows)
    if args.fit:
        for engine in sorted({row.get("engine", "tensorflow") for row in rows}):
            chosen = [row for row in rows if row.get("engine", "tensorflow") == engine]
            baseline, factor = fit(chosen)
            print(
                f"\n{engine}: baseline {baseline / 2**30:.3f} GiB, factor {factor:.3f} "
                "(memory/inference.py ENGINE_CONSTANTS)"
            )
            report(chosen, baseline, factor)
            baseline, factor = envelope(chosen)
            print(
                f"{engine} envelope (no job above its plan): baseline {baseline / 2**30:.3f} GiB, factor {factor:.3f}"
            )
            report(chosen, baseline, factor)


if __name__ == "__main__":
    main()
