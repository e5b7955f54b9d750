"""int8 (NNCF post-training quantization) against OpenVINO bfloat16 and float32: time per whole volume and
the masks' Dice agreement with float32's, on a trained run's own validation volumes.

All engines live in one process and are timed alternately (one call of each per round, after a warm-up
call that compiles), so a loaded machine slows them alike; the load averages are recorded per round.
int8 is calibrated on the run's training crops (:func:`bigmem_train.infer.int8.calibration_from_run`).

    PYTHONPATH=src python benchmarks/int8_predict.py --model RUN_DIR --repeats 3 \
        --out benchmarks/results/int8_predict-epyc.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np


def dice(first: np.ndarray, second: np.ndarray) -> float | None:
    total = int(first.sum()) + int(second.sum())
    return None if total == 0 else round(2 * int(np.logical_and(first, second).sum()) / total, 4)


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx_vnni")
            return [flag for flag in line.split(":", 1)[1].split() if flag in wanted]
    return []


def layer_seconds(model_xml: Path, shape: tuple[int, ...], hint: str) -> dict[str, float]:
    """OpenVINO's performance counters of one call, summed by (layer type, kernel): where the time goes."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(model_xml)
    model.reshape(list(shape))
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint, "PERF_COUNT": True})
    request = compiled.create_infer_request()
    volume = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    request.infer({0: volume})
    request.infer({0: volume})
    totals: dict[str, float] = {}
    for counter in request.get_profiling_info():
        key = f"{counter.node_type} {counter.exec_type}"
        totals[key] = totals.get(key, 0.0) + counter.real_time.total_seconds()
    return {
        key: round(value, 3)
        for key, value in sorted(totals.items(), key=lambda item: -item[1])
        if value > 0.005
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="run directory (checkpoints/best.keras, config.yaml)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--crops", type=int, default=32, help="calibration crops")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import nibabel as nib

    from bigmem_train.data.prepare import prepare_image
    from bigmem_train.data.reader import read_index
    from bigmem_train.infer.engine import OpenVINOEngine, converted_model
    from bigmem_train.infer.int8 import Int8Engine, calibration_from_run, int8_layers
    from bigmem_train.infer.source import resolve_model, validation_names

    source = resolve_model(args.model)
    names = validation_names(source)
    cases = [case for case in read_index(Path(source.config.data.path)) if case.name in names]
    images = {case.name: prepare_image(case.image, source.config, case.channels)[None] for case in cases}
    labels = {case.name: np.asanyarray(nib.load(case.label).dataobj) > 0 for case in cases}
    volume = images[cases[0].name]

    started = time.monotonic()
    calibration = calibration_from_run(source, args.crops)
    engines = {
        "float32": OpenVINOEngine(source.model_path, "float32"),
        "bfloat16": OpenVINOEngine(source.model_path, "bfloat16"),
        "int8": Int8Engine(source.model_path, calibration, "f32"),
        # The layers NNCF leaves in float (transposed convolutions, concatenations) in bfloat16.
        "int8+bf16": Int8Engine(source.model_path, calibration, "bf16"),
    }
    setup_seconds = round(time.monotonic() - started, 1)
    int8_count = len(int8_layers(engines["int8"].compiled(volume.shape)))
    first_call = {}
    for name, engine in engines.items():
        started = time.monotonic()
        engine(volume)
        first_call[name] = round(time.monotonic() - started, 2)

    rounds = []
    for _ in range(args.repeats):
        row = {"load_average": [round(value, 2) for value in os.getloadavg()]}
        for name, engine in engines.items():
            started = time.monotonic()
            engine(volume)
            row[name] = round(time.monotonic() - started, 3)
        rounds.append(row)

    masks = {name: {} for name in engines}
    for case_name, image in images.items():
        for name, engine in engines.items():
            masks[name][case_name] = engine(image)[0, ..., 0] > 0.5
    agreement = {
        name: {case: dice(masks[name][case], masks["float32"][case]) for case in images}
        for name in engines
        if name != "float32"
    }
    against_labels = {
        name: {case: dice(masks[name][case], labels[case]) for case in images} for name in engines
    }
    names, int8_xml, quantization = list(engines), engines["int8"].model_xml, engines["int8"].quantization
    engines.clear()  # their compiled networks freed before the profiled ones are built
    profile = {
        "bfloat16": layer_seconds(converted_model(source.model_path), volume.shape, "bf16"),
        "int8": layer_seconds(int8_xml, volume.shape, "f32"),
    }
    median = {name: float(np.median([row[name] for row in rounds])) for name in names}
    result = {
        "what": "seconds per whole volume (one engine call), engines alternating in one process",
        "command": "PYTHONPATH=src python benchmarks/int8_predict.py --model RUN_DIR --repeats "
        f"{args.repeats} --crops {args.crops}",
        "host": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "flags": cpu_flags(),
        },
        "model": {
            "run": str(args.model),
            "depth": source.config.model.depth,
            "base_filters": source.config.model.base_filters,
            "trained_crop": list(source.config.data.input_shape),
        },
        "volume_shape": list(volume.shape),
        "calibration_crops": args.crops,
        "quantization": quantization,
        "setup_seconds": setup_seconds,
        "int8_layers": int8_count,
        "first_call_seconds": first_call,
        "rounds": rounds,
        "median_seconds": median,
        "layer_seconds_one_call": profile,
        "speedup_vs_bfloat16": {name: round(median["bfloat16"] / median[name], 2) for name in names},
        "speedup_vs_float32": {name: round(median["float32"] / median[name], 2) for name in names},
        "mask_agreement_dice_vs_float32": agreement,
        "dice_vs_labels": against_labels,
        "load_average_end": [round(value, 2) for value in os.getloadavg()],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
