"""Against the limit: this CPU's achievable float32, bfloat16 and int8 rates, and the share of them that the kit's
training step and predict reach.

Peaks (all cores, best of several calls after a warm-up; 2 FLOPs per multiply-add, int8 likewise):
- TensorFlow/oneDNN: a 4096^3 matrix product and a 3x3x3 Conv3D forward at U-Net shapes, float32 and bfloat16;
- OpenVINO (the kit's predict engine): the same matrix product and convolution in f32, bf16 and int8 (weights
  and activations quantized by FakeQuantize, which OpenVINO's CPU plugin runs as an int8 kernel).
A precision's peak is the best of these.

Paths: a training step of the kit's U-Net (16 filters, depth 4, batch 1, Adam, the study's loss) at 96^3 and at
the study's tile (240x240x144; the study's batch 16 is 16 times the FLOPs of the same per-sample work, too slow
for a 2-core machine), float32 and mixed_bfloat16; and the kit's predict engine (infer/engine.py, each engine and
precision) on the whole 240x240x155 volume of benchmarks/inference_speed.py, padded to 240x240x160 (the engine
call predict makes per case; its NIfTI read and write, about 0.35 s, left out). FLOPs from memory/flops.py (the
layer table). Shares are judged by process CPU time (the rate had the cores been the process's own), as the
2-core machine is shared; wall rates are kept beside them. Where a path is under ``SLOW_SHARE`` of its
precision's peak, each multiply-add layer is timed alone at its shape (TensorFlow: forward and the gradients
training computes, or forward only for predict) and the layers that lose the most time against the path's best
layer rate are named (none was under it on 6 December 2026: no layer timings in the results file).

    .venv/bin/python benchmarks/cpu_peak.py --jobs 96³ --repeats 3   # peaks, 96³, predict: ~15 min on 2 cores
    .venv/bin/python benchmarks/cpu_peak.py --sections train --jobs "tile 240x240x144" --tile-steps 1  # merged in

Every measurement runs in a fresh process; the load average is recorded before and after each. Writes
benchmarks/results/cpu_peak-epyc.json (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
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
REPO = HERE.parent
RESULTS = HERE / "results" / "cpu_peak-epyc.json"
SECTIONS = ("peaks", "train", "predict")
# A path under this share of its precision's peak gets per-layer timings.
SLOW_SHARE = 0.60
MATMUL_EDGE = 4096
# (X, Y, Z, input channels, output channels) of the 3x3x3 convolutions timed for the peak: the study tile's
# first level at half resolution, and a deeper level.
CONV_SHAPES = ((120, 120, 72, 16, 16), (60, 60, 36, 32, 32))
TRAINING_JOBS = {"96³": (96, 96, 96), "tile 240x240x144": (240, 240, 144)}
TRAINING_PRECISIONS = ("float32", "mixed_bfloat16")
PREDICT_VARIANTS = {
    "openvino float32": ("openvino", "float32"),
    "openvino bfloat16": ("openvino", "bfloat16"),
    "tensorflow float32": ("tensorflow", "float32"),
    "tensorflow bfloat16": ("tensorflow", "bfloat16"),
    "openvino int8": ("openvino", "int8"),
}
# int8's calibration here: random crops (speed does not depend on the weights or the calibration; the kit
# calibrates on the run's training crops, infer/int8.py). Its float layers run at the kit's choice for this
# CPU (int8.float_layers_precision: bf16 where native).
INT8_CALIBRATION_CROPS, INT8_CALIBRATION_SHAPE = 4, (64, 64, 48)
PREDICT_SHAPE, PREDICT_PADDED = (240, 240, 155), (240, 240, 160)
MODEL = {"depth": 4, "base_filters": 16}
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def precision_of(name: str) -> str:
    """The peak a path is held against: float32, bfloat16 or int8."""
    return "bfloat16" if "bfloat16" in name else "int8" if "int8" in name else "float32"


# --- workers (each in its own process) ----------------------------------------------------------------------


def _best(call, repeats: int) -> tuple[float, list[float], float]:
    """The best wall time of ``repeats`` calls after a warm-up, all of them, and the least process CPU time of
    a call (shared cores: CPU seconds / cores is the call's time had the cores been its own)."""
    call()  # warm-up: primitive creation, tracing, compilation
    times, cpu_times = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), time.process_time()
        call()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    return min(times), times, min(cpu_times)


def _tensorflow_threads(tf) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(os.cpu_count())
    tf.config.threading.set_inter_op_parallelism_threads(1)


def worker_tensorflow_peaks(spec: dict) -> dict:
    import tensorflow as tf

    _tensorflow_threads(tf)
    rows = []
    for dtype in ("float32", "bfloat16"):
        edge = MATMUL_EDGE
        a = tf.cast(tf.random.normal((edge, edge)), dtype)
        b = tf.cast(tf.random.normal((edge, edge)), dtype)
        matmul = tf.function(lambda a=a, b=b: tf.linalg.matmul(a, b))
        best, times, cpu = _best(lambda matmul=matmul: matmul().numpy(), spec["repeats"])
        rows.append(_rate("tensorflow", "matmul", dtype, f"{edge}³", 2 * edge**3, best, times, cpu))
        for x, y, z, cin, cout in CONV_SHAPES:
            data = tf.cast(tf.random.normal((1, x, y, z, cin)), dtype)
            kernel = tf.cast(tf.random.normal((3, 3, 3, cin, cout)) * 0.05, dtype)
            conv = tf.function(lambda d=data, k=kernel: tf.nn.conv3d(d, k, [1] * 5, "SAME"))
            best, times, cpu = _best(lambda conv=conv: conv().numpy(), spec["repeats"])
            flops = 2 * 27 * cin * cout * x * y * z
            rows.append(
                _rate("tensorflow", "conv3d", dtype, f"{x}x{y}x{z} {cin}->{cout}", flops, best, times, cpu)
            )
    return {"rows": rows, "tensorflow": tf.__version__}


def _openvino_quantized(ov, opset, value, low, high, levels=256):
    """``value`` through a FakeQuantize: the pattern OpenVINO's CPU plugin runs as an int8 kernel where the
    activations are unsigned (256 levels from 0) and the weights symmetric (255 levels); 256 weight levels
    (a zero point) kept the f32 kernel in OpenVINO 2026.4."""
    low, high = opset.constant(low, ov.Type.f32), opset.constant(high, ov.Type.f32)
    return opset.fake_quantize(value, low, high, low, high, levels)


def worker_openvino_peaks(spec: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino.opset13 as opset

    core = ov.Core()
    rng = np.random.default_rng(0)
    rows = []

    def measure(model, inputs, precision, what, shape, flops):
        hint = {"int8": "f32", "float32": "f32", "bfloat16": "bf16"}[precision]
        compiled = core.compile_model(
            model,
            "CPU",
            {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": True},
        )
        request = compiled.create_infer_request()
        best, times, cpu = _best(lambda: request.infer(inputs), spec["repeats"])
        row = _rate("openvino", what, precision, shape, flops, best, times, cpu)
        # Which kernel ran the product: OpenVINO's own record of the node (e.g. brgemm_avx512_I8 for int8).
        kinds = {
            info.node_name: f"{info.node_type}: {info.exec_type}"
            for info in request.profiling_info
            if info.node_type.startswith(("FullyConnected", "MatMul", "Convolution"))
        }
        row["kernels"] = kinds
        return row

    for precision in ("float32", "bfloat16", "int8"):
        edge = MATMUL_EDGE
        a = opset.parameter([edge, edge], ov.Type.f32, name="a")
        weights = opset.constant(rng.standard_normal((edge, edge)).astype(np.float32) * 0.05)
        left, right = a, weights
        if precision == "int8":
            left = _openvino_quantized(ov, opset, a, 0.0, 4.0)
            right = _openvino_quantized(ov, opset, weights, -0.2, 0.2, levels=255)
        model = ov.Model([opset.matmul(left, right, False, True)], [a], "matmul")
        inputs = {"a": np.abs(rng.standard_normal((edge, edge))).astype(np.float32)}
        rows.append(measure(model, inputs, precision, "matmul", f"{edge}³", 2 * edge**3))
        for x, y, z, cin, cout in CONV_SHAPES:
            data = opset.parameter([1, cin, x, y, z], ov.Type.f32, name="data")
            kernel = opset.constant(rng.standard_normal((cout, cin, 3, 3, 3)).astype(np.float32) * 0.05)
            left, right = data, kernel
            if precision == "int8":
                left = _openvino_quantized(ov, opset, data, 0.0, 4.0)
                right = _openvino_quantized(ov, opset, kernel, -0.2, 0.2, levels=255)
            conv = opset.convolution(left, right, [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1])
            model = ov.Model([opset.relu(conv)], [data], "conv")
            inputs = {"data": np.abs(rng.standard_normal((1, cin, x, y, z))).astype(np.float32)}
            flops = 2 * 27 * cin * cout * x * y * z
            rows.append(measure(model, inputs, precision, "conv3d", f"{x}x{y}x{z} {cin}->{cout}", flops))
    return {"rows": rows, "openvino": ov.__version__}


def _rate(engine, what, precision, shape, flops, best, times, cpu) -> dict:
    return {
        "gflop_per_cpu_second_x_cores": flops / (cpu / os.cpu_count()) / 1e9,
        "engine": engine,
        "what": what,
        "precision": precision,
        "shape": shape,
        "flops": flops,
        "best_seconds": best,
        "seconds": times,
        "gflops": flops / best / 1e9,
    }


def _kit_config(shape, precision: str, batch: int = 1):
    from bigmem_train.config import config_from_dict

    return config_from_dict(
        {
            "data": {"source": "synthetic", "input_shape": list(shape), "channels": [0]},
            "model": MODEL,
            "training": {"batch_size": batch},
            "runtime": {"precision": precision},
        }
    )


def worker_train(spec: dict) -> dict:
    """Time ``steps`` training steps of the kit's compiled model after ``warmup``, on fixed synthetic data."""
    import numpy as np
    import tensorflow as tf

    from bigmem_train.memory import flops as model_flops
    from bigmem_train.memory import layers
    from bigmem_train.model.unet import compile_model

    _tensorflow_threads(tf)
    shape = tuple(spec["shape"])
    config = _kit_config(shape, spec["precision"])
    model = compile_model(config)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, *shape, 1)).astype(np.float32)
    y = (rng.random((1, *shape, 1)) < 0.05).astype(np.float32)
    times, cpu_times = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        started, cpu_started = time.perf_counter(), time.process_time()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    flops = model_flops.training_step_flops(layers.layer_table_from_keras(config), shape, 1)
    step = statistics.median(times[spec["warmup"] :])
    return {
        "shape": list(shape),
        "precision": spec["precision"],
        "warmup_seconds": times[: spec["warmup"]],
        "step_seconds": times[spec["warmup"] :],
        "median_step_seconds": step,
        "flops": flops,
        "gflops": flops / step / 1e9,
        "gflop_per_cpu_second_x_cores": flops / (min(cpu_times[spec["warmup"] :]) / os.cpu_count()) / 1e9,
    }


def worker_layers(spec: dict) -> dict:
    """Each multiply-add layer of the kit's U-Net alone at its shape: forward and, for training, the gradients
    a training step computes (the input gradient only where the step needs it)."""
    import tensorflow as tf

    from bigmem_train.memory import flops as model_flops
    from bigmem_train.memory import layers
    from bigmem_train.model.upconv import FoldedUpConv

    _tensorflow_threads(tf)
    shape, training = tuple(spec["shape"]), spec["training"]
    precision = spec["precision"]
    config = _kit_config(shape, precision)
    table = layers.layer_table_from_keras(config)
    rows = {row["name"]: row for row in table}
    dtype = "bfloat16" if "bfloat16" in precision else "float32"
    policy = "mixed_bfloat16" if dtype == "bfloat16" else "float32"
    results = []
    for layer in model_flops.layer_flops(table, shape):
        row = rows[layer.name]
        sources = [rows[name] for name in row["inputs"]]
        source_shapes = [
            (1, *(edge // divisor for edge, divisor in zip(shape, source["divisor"])), source["channels"])
            for source in sources
        ]
        if layer.kind == "FoldedUpConv":
            keras_layer = FoldedUpConv(layer.output_channels, dtype=policy)
        elif layer.kind == "Conv3DTranspose":
            keras_layer = tf.keras.layers.Conv3DTranspose(
                layer.output_channels, row["kernel_size"], strides=2, padding="same", dtype=policy
            )
        else:
            keras_layer = tf.keras.layers.Conv3D(
                layer.output_channels, row["kernel_size"], padding="same", dtype=policy
            )
        # The model's output layer computes in float32 under mixed precision, as the model builds it.
        if layer.name == "segmentation":
            keras_layer = tf.keras.layers.Conv3D(layer.output_channels, row["kernel_size"], dtype="float32")
        inputs = [tf.cast(tf.random.normal(each), dtype) for each in source_shapes]
        keras_layer(inputs if len(inputs) > 1 else inputs[0])
        watched = inputs if layer.input_gradient else []

        @tf.function
        def step(inputs=inputs, keras_layer=keras_layer, watched=watched):
            if not training:
                return keras_layer(inputs if len(inputs) > 1 else inputs[0])
            with tf.GradientTape() as tape:
                for each in watched:
                    tape.watch(each)
                out = keras_layer(inputs if len(inputs) > 1 else inputs[0])
                loss = tf.reduce_sum(tf.cast(out, tf.float32))
            gradients = tape.gradient(loss, [*watched, *keras_layer.trainable_weights])
            return [gradient for gradient in gradients if gradient is not None]

        best, times, cpu = _best(
            lambda step=step: tf.nest.map_structure(lambda t: t.numpy(), step()), spec["repeats"]
        )
        flops = layer.training if training else layer.forward
        results.append(
            {
                "name": layer.name,
                "kind": layer.kind,
                "output": list(layer.output_shape),
                "channels": [layer.input_channels, layer.output_channels],
                "flops": flops,
                "best_seconds": best,
                "cpu_seconds": cpu,
                "gflops": flops / best / 1e9,
                "gflop_per_cpu_second_x_cores": flops / (cpu / os.cpu_count()) / 1e9,
            }
        )
    return {"shape": list(shape), "precision": precision, "training": training, "layers": results}


def worker_predict(spec: dict) -> dict:
    """The kit's predict engine (infer/engine.py) on the padded whole volume: the call predict makes per case,
    without the NIfTI read and write (about 0.35 s, docs/results/inference.md)."""
    import numpy as np

    from bigmem_train.infer.engine import OpenVINOEngine, TensorFlowEngine

    if spec["engine"] == "tensorflow":
        import tensorflow as tf

        _tensorflow_threads(tf)
    extra = {}
    if spec["precision"] == "int8":
        from bigmem_train.infer.int8 import Int8Engine, calibration_from_arrays, float_layers_precision

        rng = np.random.default_rng(1)
        crops = [
            rng.standard_normal((1, *INT8_CALIBRATION_SHAPE, 1)).astype(np.float32)
            for _ in range(INT8_CALIBRATION_CROPS)
        ]
        extra["float_layers"] = float_layers_precision()
        engine = Int8Engine(Path(spec["model"]), calibration_from_arrays(crops), extra["float_layers"])
    else:
        engines = {"openvino": OpenVINOEngine, "tensorflow": TensorFlowEngine}
        engine = engines[spec["engine"]](Path(spec["model"]), spec["precision"])
    volume = np.random.default_rng(0).standard_normal((1, *PREDICT_PADDED, 1)).astype(np.float32)
    best, times, cpu = _best(lambda: engine(volume), spec["repeats"])
    return {"best_seconds": best, "seconds": times, "cpu_seconds": cpu, **extra}


WORKERS = {
    "predict": worker_predict,
    "tensorflow_peaks": worker_tensorflow_peaks,
    "openvino_peaks": worker_openvino_peaks,
    "train": worker_train,
    "layers": worker_layers,
}


# --- orchestration ----------------------------------------------------------------------------------------


def child_environment(tensorflow: bool = True) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    # The kit's defaults (runtime.allocator: tcmalloc; oneDNN on).
    env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    # OpenVINO's process aborts under tcmalloc ("free(): invalid size"); the kit's predict runs without it.
    if tensorflow and TCMALLOC.exists():
        env["LD_PRELOAD"] = str(TCMALLOC)
    return env


def run_worker(kind: str, spec: dict, timeout: float = 1800) -> dict:
    load_before = os.getloadavg()
    result = subprocess.run(
        [sys.executable, __file__, "--worker", kind, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=child_environment(tensorflow=kind != "openvino_peaks" and spec.get("engine") != "openvino"),
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{kind} {spec}: {result.stderr.strip().splitlines()[-3:]}")
    output = json.loads(result.stdout.strip().splitlines()[-1])
    output["load_before"], output["load_after"] = list(load_before), list(os.getloadavg())
    print(f"  {kind} {spec}: done (load {load_before[0]:.2f} -> {output['load_after'][0]:.2f})", flush=True)
    return output


def peaks_of(report: dict, rate: str) -> dict:
    """Each precision's peak in ``rate`` (wall ``gflops`` or ``gflop_per_cpu_second_x_cores``): the best
    measured in it, with where it was measured."""
    best: dict[str, dict] = {}
    for section in report.get("peaks", {}).values():
        for row in section["rows"]:
            if row[rate] > best.get(row["precision"], {}).get("gflops", 0):
                best[row["precision"]] = {
                    "gflops": row[rate],
                    "wall_gflops": row["gflops"],
                    "from": f"{row['engine']} {row['what']} {row['shape']}",
                }
    return best


def slowest_layers(layers: list[dict], count: int = 4) -> list[dict]:
    """The layers that hold a path back: the most CPU time spent beyond what they would take at the path's
    best layer rate (time - flops / best rate), largest first."""
    best = max(layer["flops"] / layer["cpu_seconds"] for layer in layers)
    total = sum(layer["cpu_seconds"] for layer in layers)
    for layer in layers:
        layer["share_of_time"] = layer["cpu_seconds"] / total
        layer["cpu_seconds_lost"] = layer["cpu_seconds"] - layer["flops"] / best
    ranked = sorted(layers, key=lambda layer: layer["cpu_seconds_lost"], reverse=True)
    keys = (
        "name",
        "kind",
        "output",
        "channels",
        "gflop_per_cpu_second_x_cores",
        "share_of_time",
        "cpu_seconds_lost",
    )
    return [{key: layer[key] for key in keys} for layer in ranked[:count]]


def run_peaks(args) -> dict:
    spec = {"repeats": args.repeats}
    return {
        "tensorflow": run_worker("tensorflow_peaks", spec),
        "openvino": run_worker("openvino_peaks", spec),
    }


def run_train(args) -> dict:
    rows = {}
    for label, shape in TRAINING_JOBS.items():
        if label not in args.jobs:
            continue
        for precision in TRAINING_PRECISIONS:
            steps = args.steps if shape == (96, 96, 96) else args.tile_steps
            spec = {"shape": shape, "precision": precision, "warmup": 1, "steps": steps}
            rows[f"{label} {precision}"] = run_worker("train", spec)
    return rows


UNTRAINED_MODEL = """
import pathlib
from bigmem_train.config import load_config
from bigmem_train.model.unet import build_unet
folder = pathlib.Path({folder!r})
config = load_config(None, {{"model.depth": 4, "model.base_filters": 16}})
(folder / "checkpoints").mkdir()
build_unet(config.model, (32, 32, 32), 1).save(folder / "checkpoints" / "best.keras")
"""


def run_predict(args) -> dict:
    from bigmem_train.config import load_config
    from bigmem_train.memory import flops as model_flops
    from bigmem_train.memory import layers

    config = load_config(None, {"model.depth": MODEL["depth"], "model.base_filters": MODEL["base_filters"]})
    flops = model_flops.forward_flops(layers.layer_table(config), PREDICT_PADDED)
    rows = {}
    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(workdir)
        # The network inference_speed.py predicts with (untrained weights: speed does not depend on them).
        setup = UNTRAINED_MODEL.format(folder=str(folder))
        subprocess.run([sys.executable, "-c", setup], check=True, env=child_environment(False))
        model = str(folder / "checkpoints" / "best.keras")
        for name, (engine, precision) in PREDICT_VARIANTS.items():
            spec = {"engine": engine, "precision": precision, "model": model, "repeats": args.predict_repeats}
            run = run_worker("predict", spec)
            rows[f"predict {name}"] = {
                **run,
                "flops": flops,
                "padded": list(PREDICT_PADDED),
                "gflops": flops / run["best_seconds"] / 1e9,
                "gflop_per_cpu_second_x_cores": flops / (run["cpu_seconds"] / os.cpu_count()) / 1e9,
            }
    return rows


def add_fractions_and_layers(report: dict, args) -> None:
    """Each path's share of its precision's peak, by wall time and by CPU time (the load-robust one, which
    judges); per-layer timings for paths under SLOW_SHARE by CPU time."""
    peaks = {"wall": peaks_of(report, "gflops"), "cpu": peaks_of(report, "gflop_per_cpu_second_x_cores")}
    report["peak"] = peaks
    for section in ("train", "predict"):
        for name, row in report.get(section, {}).items():
            precision = precision_of(name)
            if precision not in peaks["cpu"]:
                continue
            row["share_of_peak"] = row["gflops"] / peaks["wall"][precision]["gflops"]
            row["share_of_peak_cpu"] = row["gflop_per_cpu_second_x_cores"] / peaks["cpu"][precision]["gflops"]
            if row["share_of_peak_cpu"] >= SLOW_SHARE or args.no_layers or "layers" in row:
                continue
            if "openvino" in name:
                row["layers_note"] = (
                    "OpenVINO's own graph: per-layer times not taken (no TensorFlow layer to time)"
                )
                continue
            spec = {
                "shape": row.get("shape") or list(PREDICT_PADDED),
                "precision": "mixed_bfloat16" if precision == "bfloat16" else "float32",
                "training": section == "train",
                "repeats": 2,
            }
            timed = run_worker("layers", spec)
            row["layers"] = timed["layers"]
            row["layers_load"] = [timed["load_before"], timed["load_after"]]
            row["held_back_by"] = slowest_layers(timed["layers"])


def environment() -> dict:
    from bigmem_train.host import cpu_isa, read_cpu_flags, read_cpu_model

    flags = read_cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512vl", "amx_bf16", "amx_int8", "avx_vnni")
    versions = {}
    for package in ("tensorflow", "tensorflow-cpu", "intel-tensorflow", "openvino", "keras", "numpy"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # a package missing from the environment is recorded as such
            versions[package] = None
    return {
        "cpu": read_cpu_model(),
        "isa": cpu_isa(flags),
        "flags": sorted(flag for flag in flags if flag in wanted),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
    }


def table(report: dict, sections: tuple[str, ...] = ("train", "predict")) -> str:
    """The markdown table the results pages show: the peaks, then the paths of ``sections``."""
    lines = [
        "| path | precision | GFLOP | seconds (wall) | GFLOP/s wall | GFLOP/s by CPU time | share of peak (CPU time) |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision, peak in report.get("peak", {}).get("cpu", {}).items():
        wall = peak["wall_gflops"]  # the same measurement's wall rate
        lines.append(
            f"| peak: {peak['from']} | {precision} | | | {wall:.0f} | {peak['gflops']:.0f} | 100 % |"
        )
    for section in sections:
        for name, row in report.get(section, {}).items():
            seconds = row.get("median_step_seconds", row.get("best_seconds"))
            share = f"{row['share_of_peak_cpu'] * 100:.0f} %" if "share_of_peak_cpu" in row else "-"
            lines.append(
                f"| {name} | {precision_of(name)} | {row['flops'] / 1e9:.0f} | {seconds:.2f} | {row['gflops']:.0f} "
                f"| {row['gflop_per_cpu_second_x_cores']:.0f} | {share} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--jobs", nargs="+", default=list(TRAINING_JOBS), choices=list(TRAINING_JOBS))
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per peak measurement (best kept)")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps at 96³ after one warm-up")
    parser.add_argument("--tile-steps", type=int, default=2, help="timed training steps at the tile")
    parser.add_argument("--predict-repeats", type=int, default=2, help="timed predicts per engine, after one")
    parser.add_argument("--no-layers", action="store_true", help="skip per-layer timings of slow paths")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"default {RESULTS.relative_to(REPO)}")
    args = parser.parse_args(argv)
    if args.worker:
        kind, spec = args.worker
        print(json.dumps(WORKERS[kind](json.loads(spec))))
        return 0
    sys.path.insert(0, str(REPO / "src"))
    # Sections not run this time are kept from the results file.
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report["environment"] = environment()
    report["command"] = "python benchmarks/cpu_peak.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    runs = {"peaks": run_peaks, "train": run_train, "predict": run_predict}
    for section in args.sections:
        print(f"{section}:", flush=True)
        started = time.time()
        report[section] = (
            {**report.get(section, {}), **runs[section](args)} if section != "peaks" else runs[section](args)
        )
        report.setdefault("measured", {})[section] = time.strftime("%Y-%m-%d", time.gmtime(started))
    add_fractions_and_layers(report, args)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
