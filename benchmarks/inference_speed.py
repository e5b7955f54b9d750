"""Inference speed and memory against the warm peer: the kit's whole `bigmem-train predict` of N cases
against plain Keras ``model.predict`` at its best (issue 48).

The peer is what a user would write: the study's U-Net (4 poolings, 16 filters, FLAIR, batch 1) built at the
padded volume's shape with the kit's trained weights (below), float32, plain ``model.predict`` with the same
oneDNN TensorFlow. It runs in ``--processes`` fresh processes, each timing its first call and ``--warm`` warm
calls on the same volume; its figure is the best process's median warm call (the warm peer is bimodal on a
shared 2-vCPU EPYC: one process in four ran at 10.3 s against 5.8–6.0 s), with the spread over processes and
calls and the first calls.

The kit's side is the whole command for ``--cases`` cases, in ``--precision auto`` (the default) and each
explicit precision (int8 only where NNCF imports and the CPU has VNNI or AMX), each in fresh processes
alternating with the peer's. Per process: the first case and the steady per case (the median of the later
cases' times from predict.json; wall / N where it holds none), the command's wall time, its peak resident
set (the process tree's, from wait4), and the precision predict.json says ran and why. One untimed run of
each variant first fills the OpenVINO conversion cache beside the model, as a user's second predict finds it.

The model is a real run of the study's network: ``bigmem-train run`` (untimed, once per invocation, or an
earlier one reused with ``--run DIR``) trains it briefly on a small synthetic Decathlon-layout dataset
(:data:`TRAINING_JOB`: 64x64x48 crops), so the run has a split.json and labelled validation cases. auto's
Dice gate (:mod:`bigmem_train.infer.precision`) therefore runs on them, in the first untimed predict, and
picks int8, bfloat16 or float32; explicit int8 (NNCF, calibrated on the run's training crops) runs where
its gate passes. The file records the training (its seconds and its whole-volume validation Dice), which
precision auto chose and why, and the gates' figures (pooled Dice per structure of each precision and of
float32, and their masks' agreement) from predict.json and precision-gate.json. ``--epochs`` sets the
training's length; the volumes predicted are the random ones of before (speed does not depend on them).

Ratios come from the same run's medians: the peer's best warm call over the kit's median steady per case,
the kit's median peak over the peer's median peak. The load average is recorded before every process.

    python benchmarks/inference_speed.py --out benchmarks/results/inference_speed-warm-epyc.json
    python benchmarks/inference_speed.py --shape 160 160 96 --out ...   # a smaller volume, said in the file
    python benchmarks/inference_speed.py --run /tmp/study-run ...   # train there once, reuse it afterwards

Writes benchmarks/results/inference_speed-warm-epyc.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "inference_speed-warm-epyc.json"
STUDY_SHAPE = (240, 240, 155)
# 4 poolings: each padded side a multiple of 2**4.
POOLING_MULTIPLE = 16
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
# The kit's model: the study's network (4 poolings, 16 base filters, FLAIR, tumour against the rest) trained
# briefly on 12 synthetic cases (9 train, 3 validation) in 64x64x48 crops: a few minutes on 2 cores, enough
# to learn the phantom's tumour, so the gate compares real masks. results_dir and run_name are added.
TRAINING_JOB = {
    "data": {
        "source": "synthetic",
        "synthetic_cases": 12,
        "synthetic_shape": [72, 72, 56],
        "input_shape": [64, 64, 48],
        "channels": [0],
        "label_mode": "binary",
        "crop_jitter": 4,
    },
    "model": {"depth": 4, "base_filters": 16},
    "training": {"batch_size": 2, "epochs": 10, "learning_rate": 0.003},
    "output": {"tensorboard": False},
}

CASES = """
import pathlib, numpy as np, nibabel as nib
folder = pathlib.Path({folder!r})
(folder / "cases").mkdir()
for index in range({cases}):
    rng = np.random.default_rng(index)
    data = rng.integers(0, 1000, size=({shape}, 4), dtype=np.int16)
    data[:20], data[-20:] = 0, 0
    nib.save(nib.Nifti1Image(data, np.eye(4)), folder / "cases" / f"case{{index}}.nii.gz")
"""

PEER = """
import json, time, numpy as np, nibabel as nib, keras
import bigmem_train.model.unet  # the kit's layers, for loading its archive
from bigmem_train.config import load_config
from bigmem_train.model.unet import build_unet
folder, run = {folder!r}, {run!r}
config = load_config(run + "/config.yaml")
saved = keras.models.load_model({model!r}, compile=False)
model = build_unet(config.model, {padded}, 1)  # the model at the padded volume's shape, as a user builds it
model.set_weights(saved.get_weights())  # the run's trained weights, as the kit predicts with
image = np.asarray(nib.load(folder + "/cases/case0.nii.gz").dataobj[..., 0], dtype=np.float32)
brain = image != 0
image[brain] = (image[brain] - image[brain].mean()) / image[brain].std()
volume = np.zeros((1, *{padded}, 1), np.float32)
volume[0, {slices}, 0] = image
calls = []
for _ in range({warm} + 1):
    start = time.perf_counter()
    model.predict(volume, verbose=0)
    calls.append(time.perf_counter() - start)
print(json.dumps({{"first_seconds": calls[0], "warm_seconds": calls[1:]}}))
"""

VARIANTS = {
    "kit auto": ["--precision", "auto"],
    "kit float32": ["--precision", "float32"],
    "kit bfloat16": ["--precision", "bfloat16"],
    "kit int8": ["--precision", "int8"],
}


def padded_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-side // POOLING_MULTIPLE) * POOLING_MULTIPLE for side in shape)


def int8_available() -> tuple[bool, str]:
    """int8 is measured where NNCF imports and the CPU has VNNI or AMX."""
    from bigmem_train.host import read_cpu_flags

    flags = read_cpu_flags()
    if not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags):
        return False, "the CPU has neither VNNI nor AMX"
    if importlib.util.find_spec("nncf") is None:
        return False, "nncf is not installed"
    return True, "nncf imports and the CPU has VNNI or AMX"


def train_run(run: Path, log: Path, epochs: int) -> dict:
    """The kit's model: ``run`` reused when it holds a trained model, else trained there now by
    ``bigmem-train run`` (untimed by the benchmark; its own seconds recorded). Raises SystemExit when the run
    is not the study's network or training leaves no model."""
    import yaml

    from bigmem_train.errors import BadInput
    from bigmem_train.infer.source import resolve_model, validation_names

    trained_here = not (run / "checkpoints" / "best.keras").is_file()
    command_seconds = None
    if trained_here:
        job = {
            **TRAINING_JOB,
            "training": {**TRAINING_JOB["training"], "epochs": epochs},
            "output": {**TRAINING_JOB["output"], "results_dir": str(run.parent), "run_name": run.name},
        }
        run.parent.mkdir(parents=True, exist_ok=True)
        config_path = run.parent / f"{run.name}.yaml"
        config_path.write_text(yaml.safe_dump(job, sort_keys=False))
        print(f"training the kit's model in {run} (untimed; log {log})", flush=True)
        command = [sys.executable, "-m", "bigmem_train.cli", "run", "--config", str(config_path)]
        started = time.perf_counter()
        with log.open("w") as output:
            returncode = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=ENV).returncode
        command_seconds = round(time.perf_counter() - started, 1)
        # Exit 1 is a verdict that failed (a Dice floor missed): the model exists and the gate judges it.
        if returncode not in (0, 1) or not (run / "checkpoints" / "best.keras").is_file():
            raise SystemExit(
                f"training the kit's model failed (exit {returncode}): {log.read_text()[-2000:]}"
            )
    try:
        source = resolve_model(run)
        validation = sorted(validation_names(source))
    except BadInput as error:
        raise SystemExit(f"--run {run}: {error}") from None
    model, config = source.config.model, source.config
    if (model.depth, model.base_filters, source.input_channels, source.output_classes) != (4, 16, 1, 1):
        raise SystemExit(
            f"--run {run}: not the study's network (depth 4, 16 base filters, 1 channel, 1 class): depth "
            f"{model.depth}, {model.base_filters} base filters, {source.input_channels} channel(s), "
            f"{source.output_classes} class(es)"
        )
    metrics = _read_json(run / "metrics.json")
    evaluation = _read_json(run / "evaluation" / "evaluation.json")
    return {
        "run": str(run),
        "model": str(source.model_path),
        "trained_here": trained_here,
        "command_seconds": command_seconds,
        "train_seconds": metrics.get("train_seconds_this_session"),
        "epochs": config.training.epochs,
        "batch_size": config.training.batch_size,
        "crop": list(config.data.input_shape),
        "dataset": str(config.data.path),
        "train_cases": metrics.get("train_cases"),
        "validation_cases": validation,
        "validation_dice": {
            structure: {key: row[key] for key in ("pooled_dice", "mean_dice", "cases")}
            for structure, row in (evaluation.get("summary") or {}).items()
        },
        "verdict": _read_json(run / "verdict.json").get("verdict"),
    }


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def timed_process(command: list[str], log: Path) -> dict:
    """Run ``command`` in a fresh process: exit status, wall seconds, peak resident set of its tree."""
    load = os.getloadavg()
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=ENV)
        _, status, usage = os.wait4(process.pid, 0)
    return {
        "returncode": os.waitstatus_to_exitcode(status),
        "wall_seconds": round(time.perf_counter() - started, 3),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "load_before": [round(value, 2) for value in load],
    }


def run_peer(
    folder: Path, training: dict, padded: tuple[int, ...], shape: tuple[int, ...], warm: int, index: int
) -> dict:
    slices = ", ".join(f"{(p - s) // 2}:{(p - s) // 2 + s}" for p, s in zip(padded, shape, strict=True))
    script = PEER.format(
        folder=str(folder),
        run=training["run"],
        model=training["model"],
        padded=padded,
        slices=slices,
        warm=warm,
    )
    log = folder / f"peer-{index}.log"
    result = timed_process([sys.executable, "-c", script], log)
    if result["returncode"] != 0:
        raise RuntimeError(f"the peer failed: {log.read_text()[-2000:]}")
    result.update(json.loads(log.read_text().strip().splitlines()[-1]))
    return result


def run_kit(folder: Path, run: str, name: str, index: int, cases: int | None = None) -> dict:
    out = folder / f"{name.replace(' ', '-')}-{index}"
    data = sorted((folder / "cases").glob("*.nii.gz"))[:cases]
    command = [sys.executable, "-m", "bigmem_train.cli", "predict", "--model", run, "--data"]
    command += [*map(str, data), "--out", str(out), "--engine", "openvino", *VARIANTS[name]]
    log = folder / f"{out.name}.log"
    result = timed_process(command, log)
    summary_path = out / "predict.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    times = [case["seconds"] for case in summary.get("cases", {}).values()]
    result.update(
        {
            "precision": summary.get("precision"),
            "precision_reason": summary.get("precision_reason"),
            "precision_gate": summary.get("precision_gate"),
            "case_seconds": times,
        }
    )
    if result["returncode"] != 0 or len(times) != len(data):
        lines = log.read_text().strip().splitlines()
        result["error"] = lines[-1] if lines else ""
        return result
    result["first_case_seconds"] = times[0]
    result["steady_seconds"] = (
        statistics.median(times[1:]) if len(times) > 1 else result["wall_seconds"] / len(data)
    )
    result["steady_from"] = "predict.json, cases 2 and later" if len(times) > 1 else "wall / N"
    return result


def summarize(runs: dict[str, list[dict]]) -> dict:
    peer = runs["peer"]
    medians = [statistics.median(run["warm_seconds"]) for run in peer]
    warm_calls = [seconds for run in peer for seconds in run["warm_seconds"]]
    summary = {
        "peer": {
            "best_process_median_warm_seconds": round(min(medians), 3),
            "process_median_warm_seconds": [round(value, 3) for value in medians],
            "warm_range_seconds": [round(min(warm_calls), 3), round(max(warm_calls), 3)],
            "first_call_seconds": [round(run["first_seconds"], 3) for run in peer],
            "median_peak_gib": round(statistics.median(run["peak_rss_bytes"] for run in peer) / 2**30, 3),
        }
    }
    # Ratios from the unrounded medians.
    best, peer_peak = min(medians), statistics.median(run["peak_rss_bytes"] for run in peer)
    for name, rows in runs.items():
        if name == "peer":
            continue
        done = [row for row in rows if "steady_seconds" in row]
        if not done:
            summary[name] = {
                "measured": False,
                "why": rows[0].get("error"),
                "returncode": rows[0]["returncode"],
            }
            continue
        steady = statistics.median(row["steady_seconds"] for row in done)
        peak = statistics.median(row["peak_rss_bytes"] for row in done)
        summary[name] = {
            "measured": True,
            "precision_ran": sorted({row["precision"] for row in done}),
            "precision_reason": done[0]["precision_reason"],
            "precision_gate": gate_figures(done[0].get("precision_gate")),
            "median_first_case_seconds": round(
                statistics.median(row["first_case_seconds"] for row in done), 3
            ),
            "median_steady_seconds": round(steady, 3),
            "steady_range_seconds": [
                round(min(row["steady_seconds"] for row in done), 3),
                round(max(row["steady_seconds"] for row in done), 3),
            ],
            "median_wall_seconds": round(statistics.median(row["wall_seconds"] for row in done), 3),
            "wall_range_seconds": [
                round(min(row["wall_seconds"] for row in done), 3),
                round(max(row["wall_seconds"] for row in done), 3),
            ],
            "median_peak_gib": round(peak / 2**30, 3),
            "vs_peer_best_warm": round(best / steady, 3),
            "vs_peer_peak_memory": round(peak / peer_peak, 3),
        }
    return summary


def gate_figures(gates: dict | None) -> dict | None:
    """Per candidate, what its gate says (predict.json's or precision-gate.json's record, without its paths):
    pooled Dice per structure of float32 and of the candidate against the labels, their masks' agreement."""
    if not gates:
        return None
    keys = (
        "skipped",
        "cases",
        "pooled_dice",
        "agreement_dice",
        "passed",
        "failures",
        "seconds",
        "thresholds",
    )
    return {
        candidate: {key: record[key] for key in keys if key in record} for candidate, record in gates.items()
    }


def precision_gate(training: dict, warmup: dict) -> dict:
    """What auto chose in its first (untimed) predict, which ran the gate, and precision-gate.json's records."""
    auto = warmup.get("kit auto", {})
    stored = _read_json(Path(training["model"]).parent / "precision-gate.json").get("gates", {})
    return {
        "auto_chose": auto.get("precision"),
        "auto_reason": auto.get("precision_reason"),
        "auto_gates": gate_figures(auto.get("precision_gate")),
        # precision-gate.json's entries are keyed "digest engine precision": here "engine precision".
        "file": {key.split(" ", 1)[-1]: figures for key, figures in (gate_figures(stored) or {}).items()},
    }


def versions() -> dict:
    found = {"python": platform.python_version()}
    # TensorFlow is installed under one of several distribution names.
    names = {"tensorflow": ("tensorflow", "tensorflow-cpu", "intel-tensorflow")}
    for package in ("tensorflow", "keras", "openvino", "nncf", "numpy"):
        found[package] = None
        for name in names.get(package, (package,)):
            try:
                found[package] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def print_table(summary: dict, cases: int, training: dict, gate: dict) -> None:
    dice = ", ".join(f"{name} {row['pooled_dice']:.4f}" for name, row in training["validation_dice"].items())
    seconds = training["train_seconds"]
    print(
        f"model: {training['run']} ({'trained now' if training['trained_here'] else 'reused'}, "
        f"{training['epochs']} epochs of {'x'.join(map(str, training['crop']))} crops"
        f"{f' in {seconds:.0f} s' if seconds is not None else ''}; validation pooled Dice {dice or 'none'})"
    )
    print(f"auto chose {gate['auto_chose']}: {gate['auto_reason']}")
    for candidate, record in sorted((gate["auto_gates"] or {}).items()):
        if "skipped" in record:
            print(f"  gate {candidate}: skipped ({record['skipped']})")
            continue
        figures = "; ".join(
            f"{structure} {record['pooled_dice'][candidate][structure]:.4f} vs float32 {value:.4f}, "
            f"agreement {record['agreement_dice'][structure]:.4f}"
            for structure, value in record["pooled_dice"]["float32"].items()
        )
        print(f"  gate {candidate}: {'passed' if record['passed'] else 'missed'} ({figures})")
    peer = summary["peer"]
    print(
        f"| | precision ran | first case s | steady s/case | wall s ({cases} cases) | peak GiB | speed | memory |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| peer, best warm (processes {', '.join(f'{v:.2f}' for v in peer['process_median_warm_seconds'])}; "
        f"first {', '.join(f'{v:.2f}' for v in peer['first_call_seconds'])}) | float32 | | "
        f"{peer['best_process_median_warm_seconds']:.2f} ({peer['warm_range_seconds'][0]:.2f}–"
        f"{peer['warm_range_seconds'][1]:.2f}) | | {peer['median_peak_gib']:.2f} | 1.00x | 1.00x |"
    )
    for name, row in summary.items():
        if name == "peer":
            continue
        if not row["measured"]:
            print(f"| {name} | not measured: {row['why']} | | | | | | |")
            continue
        print(
            f"| {name} | {', '.join(row['precision_ran'])} | {row['median_first_case_seconds']:.2f} | "
            f"{row['median_steady_seconds']:.2f} ({row['steady_range_seconds'][0]:.2f}–"
            f"{row['steady_range_seconds'][1]:.2f}) | {row['median_wall_seconds']:.1f} "
            f"({row['wall_range_seconds'][0]:.1f}–{row['wall_range_seconds'][1]:.1f}) | "
            f"{row['median_peak_gib']:.2f} | {row['vs_peer_best_warm']:.2f}x | {row['vs_peer_peak_memory']:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per side (default 3)")
    parser.add_argument("--warm", type=int, default=3, help="the peer's warm calls per process (default 3)")
    parser.add_argument("--cases", type=int, default=3, help="cases per kit command (default 3)")
    parser.add_argument(
        "--shape", type=int, nargs=3, default=STUDY_SHAPE, help="volume shape (default the study's)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--run",
        type=Path,
        help="the kit's model: a run of the study's network to reuse, or where to train one and keep it "
        "(default: trained in a temporary folder and deleted)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=TRAINING_JOB["training"]["epochs"],
        help=f"epochs of a run trained now (default {TRAINING_JOB['training']['epochs']})",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"default {RESULTS.relative_to(HERE.parent)}"
    )
    args = parser.parse_args()
    shape, started = tuple(args.shape), time.time()
    padded = padded_shape(shape)
    variants = list(args.variants)
    int8_ok, int8_why = int8_available()
    if "kit int8" in variants and not int8_ok:
        variants.remove("kit int8")
    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(workdir)
        run = (args.run or folder / "runs" / "study-unet").resolve()
        training = train_run(run, folder / "training.log", args.epochs)
        setup = CASES.format(folder=str(folder), shape=", ".join(map(str, shape)), cases=args.cases)
        subprocess.run([sys.executable, "-c", setup], check=True, env=ENV)
        # The first predict of auto runs its gate on the run's validation cases (cached beside the model).
        warmup = {name: run_kit(folder, training["run"], name, -1, cases=1) for name in variants}
        gate = precision_gate(training, warmup)
        runs: dict[str, list[dict]] = {name: [] for name in ["peer", *variants]}
        for index in range(args.processes):
            for name in runs:
                if name == "peer":
                    result = run_peer(folder, training, padded, shape, args.warm, index)
                    text = f"first {result['first_seconds']:.2f} s, warm " + ", ".join(
                        f"{value:.2f}" for value in result["warm_seconds"]
                    )
                else:
                    result = run_kit(folder, training["run"], name, index)
                    text = result.get("error") or (
                        f"{result['precision']}: first {result['first_case_seconds']:.2f} s, steady "
                        f"{result['steady_seconds']:.2f} s, wall {result['wall_seconds']:.1f} s"
                    )
                runs[name].append(result)
                print(
                    f"{name} {index + 1}: {text}, peak {result['peak_rss_bytes'] / 2**30:.2f} GiB "
                    f"(load {result['load_before'][0]:.2f})",
                    flush=True,
                )
    from bigmem_train.host import cpu_isa, read_cpu_flags, read_cpu_model

    summary = summarize(runs)
    auto = summary.get("kit auto", {})
    int8 = summary.get("kit int8", {})
    goals = {
        "default_speed_at_least": 2.4,
        "default_memory_at_most": 0.4,
        "int8_speed_at_least": 3.0,
        "default_met": bool(
            auto.get("measured") and auto["vs_peer_best_warm"] >= 2.4 and auto["vs_peer_peak_memory"] <= 0.4
        ),
        "int8_met": bool(int8.get("measured") and int8["vs_peer_best_warm"] >= 3.0),
    }
    loads = [run["load_before"][0] for rows in runs.values() for run in rows]
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "shape": list(shape),
        "padded": list(padded),
        "study_shape": shape == STUDY_SHAPE,
        "shape_note": None
        if shape == STUDY_SHAPE
        else f"a smaller volume than the study's {'x'.join(map(str, STUDY_SHAPE))}, to fit the time at hand",
        "model": {
            "depth": 4,
            "base_filters": 16,
            "channels": ["FLAIR"],
            "weights": "trained: the run below",
        },
        "training": training,
        "precision_gate": gate,
        "processes": args.processes,
        "warm_calls": args.warm,
        "cases": args.cases,
        "int8": {"measured": "kit int8" in variants, "why": int8_why},
        "cpu": {"model": read_cpu_model(), "isa": cpu_isa(read_cpu_flags()), "cpus": os.cpu_count()},
        "versions": versions(),
        "load_before_range": [min(loads), max(loads)],
        "seconds_total": round(time.time() - started),
        "warmup": warmup,
        "runs": runs,
        "summary": summary,
        "goals": goals,
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print_table(summary, args.cases, training, gate)
    print(json.dumps(goals))


if __name__ == "__main__":
    main()
