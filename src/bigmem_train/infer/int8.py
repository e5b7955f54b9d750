"""``predict --precision int8``: the OpenVINO model quantized after training by NNCF (the optional ``int8``
extra), calibrated on crops of the run's own training cases, and run by OpenVINO's int8 kernels (VNNI or AMX).

- The float model is OpenVINO's converted copy (:func:`.engine.converted_model`, in a folder named by the
  model file's digest); its int8 copy sits beside it as ``int8-<key>.xml``, the key naming the calibration set
  and the quantization settings: a changed model file (another folder) or another calibration set
  quantizes again, a repeat reads the file.
- Calibration: :data:`CALIBRATION_CROPS` crops at ``data.input_shape`` from the run's training cases
  (``split.json``), each cut as training cuts one (:func:`.data.prepare.prepare_case`: jitter, flips,
  z-score), read through the kit's reader, so real NIfTI works.
- Quantization: NNCF's ``performance`` preset (symmetric int8 weights per channel and activations: what
  VNNI's u8 x s8 dot product runs), fast bias correction, CPU target, on the model as
  :func:`prepared_for_int8` rewrites it (the folded up-convolutions made quantizable). Every convolution and
  transposed convolution runs int8, the first and the 1x1 output included (the sigmoid stays float32); what
  NNCF leaves in float (the concatenations, the bias halves, the sigmoid and the tensors between them) runs
  at ``Int8Engine``'s ``float_precision``: bfloat16 where the CPU computes it natively (AVX512_BF16 or AMX),
  as OpenVINO's own default there, else float32 (:func:`float_layers_precision`). On the study's volume
  (2-vCPU EPYC) bfloat16 float layers took the int8 model's peak from 1.78 to 1.16 GiB and a call from 1.55
  to 1.37 s. Agreement with float32's masks is measured by benchmarks/int8_predict.py.

Whether a model's int8 masks are good enough is the precision gate's call (:mod:`.precision`); a model that
misses it is refused with both Dice figures (:class:`Int8Refused`, exit 1).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bigmem_train.data.prepare import prepare_case
from bigmem_train.data.reader import read_index
from bigmem_train.errors import EXIT_FAIL, BadInput, BigmemError
from bigmem_train.infer.engine import (
    NATIVE_FLAGS,
    cached_or_made,
    converted_model,
    file_digest,
    native_precisions,
)
from bigmem_train.infer.source import ModelSource

# CPU flags with a native int8 dot product (VNNI in AVX-512 or AVX, AMX's int8 tiles): int8 is then the
# fastest precision; without them OpenVINO emulates it and int8 is not offered. Defined in engine.py's table.
INT8_FLAGS = NATIVE_FLAGS["int8"]
# Crops the calibration reads: NNCF's statistics settle within a few dozen samples of one network.
CALIBRATION_CROPS = 32
# NNCF release paired with the installed OpenVINO (2026.4): pyproject's ``int8`` extra.
INSTALL_HINT = "pip install 'bigmem-train[int8]' (NNCF 3.4, paired with OpenVINO 2026.4)"
# What the quantization does, in the cache key: a change here quantizes every model again.
QUANTIZATION = {"preset": "performance", "fast_bias_correction": True, "target_device": "CPU", "version": 2}


class Int8Refused(BigmemError):
    """``--precision int8`` asked for, but the int8 masks miss the Dice gate of float32's (exit 1)."""

    exit_code = EXIT_FAIL


def float_layers_precision(cpu_flags: Iterable[str] | None = None) -> str:
    """OpenVINO's inference precision hint for the layers NNCF leaves in float: "bf16" where this CPU (or
    one with ``cpu_flags``) computes bfloat16 natively, else "f32". The precision gate judges int8 with
    the float layers it will run with (its key names them)."""
    from bigmem_train.host import this_cpu_flags

    flags = this_cpu_flags() if cpu_flags is None else cpu_flags
    return "bf16" if "bfloat16" in native_precisions(flags) else "f32"


def nncf_available() -> bool:
    try:
        return importlib.util.find_spec("nncf") is not None
    except (ImportError, ValueError):  # ValueError: a module entry without a spec (a stubbed-out import)
        return False


def int8_unavailable(engine: str, cpu_flags: Iterable[str] | None = None) -> str | None:
    """Why int8 cannot run here (None: it can): another engine than OpenVINO, NNCF missing, or
    (``cpu_flags`` given) no native int8 dot product. ``--precision auto`` skips int8 with this reason."""
    if engine != "openvino":
        return f"runs on the OpenVINO engine only, not --engine {engine}"
    if not nncf_available():
        return f"NNCF is not installed; {INSTALL_HINT}"
    if cpu_flags is not None and not INT8_FLAGS & set(cpu_flags):
        return (
            "this CPU has no native int8 dot product (VNNI or AMX); it would be emulated, slower than float32"
        )
    return None


def check_int8(engine: str, cpu_flags: Iterable[str] | None = None) -> None:
    """BadInput (exit 2, one line) when int8 cannot run here (:func:`int8_unavailable`)."""
    reason = int8_unavailable(engine, cpu_flags)
    if reason is not None:
        raise BadInput(f"--precision int8: {reason}")


def refusal(record: dict) -> Int8Refused:
    """The error for an int8 gate that failed: both Dice figures per structure, and agreement, in one line.
    ``record`` is a gate result (:func:`.precision.run_gate`): pooled_dice, agreement_dice, failures."""
    pooled = record["pooled_dice"]
    figures = "; ".join(
        f"{structure} pooled Dice int8 {pooled['int8'][structure]:.4f} vs float32 {value:.4f}, "
        f"agreement {record['agreement_dice'][structure]:.4f}"
        for structure, value in pooled["float32"].items()
    )
    return Int8Refused(
        f"--precision int8: refused, the int8 masks miss the Dice gate of float32 on {len(record['cases'])} "
        f"validation case(s) ({figures}); use --precision bfloat16 or float32"
    )


@dataclass(frozen=True)
class Calibration:
    """A calibration set: ``key`` names it in the int8 file's name (the same key, the same crops);
    ``batches`` yields its (1, X, Y, Z, C) float32 crops, read only when a model is quantized."""

    key: str
    count: int
    batches: Callable[[], Iterable[np.ndarray]]


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibration_from_arrays(crops: Sequence[np.ndarray]) -> Calibration:
    """Crops held in memory (tests, benchmarks), keyed by their bytes."""
    arrays = [np.ascontiguousarray(crop, dtype=np.float32) for crop in crops]
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(repr(array.shape).encode())
        digest.update(array.tobytes())
    return Calibration(digest.hexdigest()[:16], len(arrays), lambda: iter(arrays))


def calibration_from_run(source: ModelSource, count: int = CALIBRATION_CROPS) -> Calibration:
    """``count`` training crops of the run ``source`` was trained in: its ``split.json``'s training cases
    in the run's dataset (``data.path``), taken in turn, each crop seeded as training seeds one. Keyed by
    the cases' files (name, size, modification time) and the crop settings, so nothing is read to find
    a cached int8 model."""
    config = source.config
    split_path = source.config_path.parent / "split.json"
    try:
        names = json.loads(split_path.read_text())["train"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BadInput(
            f"--precision int8: calibrates on the run's training crops, but {split_path} cannot be read: "
            "give --model the run directory the model was trained in"
        ) from None
    folder = Path(config.data.path) if config.data.path is not None else None
    if folder is None or not (folder / "dataset.json").is_file():
        raise BadInput(
            f"--precision int8: calibrates on the run's training crops, but its dataset {folder} is not here"
        )
    cases = [case for case in read_index(folder) if case.name in set(names)]
    if not cases:
        raise BadInput(f"--precision int8: none of the run's training cases ({split_path}) is in {folder}")
    chosen = [cases[number % len(cases)] for number in range(count)]
    files = []
    for case in dict.fromkeys(chosen):
        stat = case.image.stat()
        files.append([case.name, str(case.image), stat.st_size, stat.st_mtime_ns])
    settings = {
        "files": files,
        "count": count,
        "seed": config.training.seed,
        "input_shape": list(config.data.input_shape),
        "channels": str(config.data.channels),
        "crop_jitter": config.data.crop_jitter,
        "flips": config.data.augment_flips,
    }

    def batches() -> Iterable[np.ndarray]:
        for number, case in enumerate(chosen):
            image, _ = prepare_case(case, config, np.random.default_rng([config.training.seed, number]))
            yield image[None]

    return Calibration(_short_hash(json.dumps(settings, sort_keys=True)), count, batches)


def quantize(model, calibration_batches: Iterable[np.ndarray], target: Path) -> Path:
    """Quantize ``model`` (an ``openvino.Model`` or its .xml) with NNCF on ``calibration_batches`` and write the
    int8 model to ``target`` (.xml and .bin) atomically: the .xml, which marks it done, is renamed last."""
    if not nncf_available():
        raise BadInput(f"--precision int8: NNCF is not installed; {INSTALL_HINT}")
    import nncf
    import openvino as ov

    if not isinstance(model, ov.Model):
        model = ov.Core().read_model(model)
    crops = list(calibration_batches)
    if not crops:
        raise BadInput("--precision int8: the calibration set is empty")
    quantized = nncf.quantize(
        prepared_for_int8(model.clone()),
        nncf.Dataset(crops),
        preset=nncf.QuantizationPreset.PERFORMANCE,
        target_device=nncf.TargetDevice.CPU,
        subset_size=len(crops),
        fast_bias_correction=QUANTIZATION["fast_bias_correction"],
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".partial-{os.getpid()}-{target.name}")
    ov.save_model(quantized, partial, compress_to_fp16=False)
    partial.with_suffix(".bin").replace(target.with_suffix(".bin"))
    partial.replace(target)
    return target


def _from_constants(node) -> bool:
    """Whether ``node``'s value depends on no input of the model (constants and ops on them only)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node.get_type_name() == "Parameter":
            return False
        stack.extend(node.input_value(index).get_node() for index in range(node.get_input_size()))
    return True


def prepared_for_int8(model):
    """``model`` rewritten, with the same arithmetic, so NNCF can quantize the kit's folded up-convolutions
    (model/upconv.py): their 4x4x4 kernels, computed from the saved kernels by einsums, become constants
    (NNCF quantizes constant weights only), and the channel of ones that carries the transposed
    convolution's bias is split off into a convolution of its own (a concatenation of int8 activations with
    float ones left the whole transposed convolution in float32: a third of int8's time, measured)."""
    import openvino as ov
    from openvino import opset13 as ops

    core = ov.Core()
    for op in list(model.get_ordered_ops()):
        if op.get_type_name() not in ("Convolution", "ConvolutionBackpropData"):
            continue
        weights = op.input_value(1)
        if weights.get_node().get_type_name() != "Constant" and _from_constants(weights.get_node()):
            constant = ov.Model([ops.result(weights)], [])
            value = core.compile_model(constant, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({})[0]
            op.input(1).replace_source_output(ops.constant(np.asarray(value)).output(0))
        data = op.input_value(0).get_node()
        folded = data.get_type_name() == "Concat" and data.get_input_size() == 2
        if (
            op.get_type_name() != "ConvolutionBackpropData"
            or not folded
            or data.get_attributes()["axis"] != 1
        ):
            continue
        kernel = op.input_value(1).get_node()
        if kernel.get_type_name() != "Constant":
            continue
        kernel = kernel.get_data()
        channels = data.input_value(0).get_partial_shape()[1]
        if not channels.is_static:
            continue
        split = channels.get_length()
        attributes = op.get_attributes()
        settings = {
            name: attributes[name]
            for name in ("strides", "pads_begin", "pads_end", "dilations", "auto_pad", "output_padding")
        }
        halves = [
            ops.convolution_backprop_data(
                data.input_value(index),
                ops.constant(np.ascontiguousarray(part)),
                output_shape=op.input_value(2),
                **settings,
            )
            for index, part in enumerate((kernel[:split], kernel[split:]))
        ]
        total = ops.add(*halves)
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(total.output(0))
    model.validate_nodes_and_infer_types()
    return model


def quantized_model(
    model_path: Path, calibration: Calibration, quantized: Callable[[dict], None] | None = None
) -> Path:
    """The int8 model.xml for a ``.keras`` file and ``calibration``: from beside the float model's converted
    copy, else quantized now (how long it took handed to ``quantized``). Where that folder cannot be written
    (a read-only cache), under the temporary folder, keyed alike."""
    float_model = converted_model(model_path)
    name = f"int8-{_short_hash(json.dumps([calibration.key, QUANTIZATION], sort_keys=True))}.xml"
    fallback = Path(tempfile.gettempdir()) / "bigmem-train-openvino" / file_digest(model_path) / name

    def quantize_to(target: Path) -> bool:
        print(
            f"predict: quantizing the model to int8 on {calibration.count} training crops (once per model)",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        quantize(float_model, calibration.batches(), target)
        if quantized is not None:
            quantized({"seconds": round(time.monotonic() - started, 1), "crops": calibration.count})
        return True

    refusal = f"{model_path}: no writable folder for the int8 model (set BIGMEM_CACHE_DIR)"
    return cached_or_made([float_model.parent / name, fallback], quantize_to, refusal)


def int8_layers(compiled_model) -> list[str]:
    """The layers of a compiled OpenVINO model that its CPU plugin runs in int8 (runtime precision I8 or U8)."""
    layers = []
    for op in compiled_model.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        precision = info["runtimePrecision"].astype(str).upper() if "runtimePrecision" in info else ""
        if precision in ("I8", "U8"):
            layers.append(op.get_friendly_name())
    return layers


class Int8Engine:
    """The int8 model, compiled once per input shape; called like the float engines (:mod:`.engine`):
    a (1, X, Y, Z, C) float32 volume in, (1, X, Y, Z, K) float32 probabilities out. Layers NNCF left in
    float run at ``float_precision`` (OpenVINO's hint: f32 exact, bf16 faster where native)."""

    name = "openvino"
    precision = "int8"

    def __init__(self, model_path: Path, calibration: Calibration, float_precision: str = "f32"):
        import openvino as ov

        self._core = ov.Core()
        self.float_precision = float_precision
        # How the one-time quantization went (None: the int8 model came from the cache).
        self.quantization: dict | None = None
        self.model_xml = quantized_model(model_path, calibration, self._quantization_done)
        self._model = self._core.read_model(self.model_xml)
        self._hint = {"INFERENCE_PRECISION_HINT": float_precision}
        self._compiled: dict[tuple[int, ...], object] = {}

    def _quantization_done(self, record: dict) -> None:
        self.quantization = record

    def compiled(self, shape: tuple[int, ...]):
        """The model compiled for ``shape``; one shape at a time, as the float engine keeps it."""
        compiled = self._compiled.get(shape)
        if compiled is None:
            model = self._model.clone()
            model.reshape(list(shape))
            self._compiled.clear()
            compiled = self._compiled[shape] = self._core.compile_model(model, "CPU", self._hint)
        return compiled

    def __call__(self, volume: np.ndarray) -> np.ndarray:
        return np.asarray(self.compiled(volume.shape)(volume)[0], dtype=np.float32)


def make_int8_engine(
    source: ModelSource,
    engine: str = "openvino",
    count: int = CALIBRATION_CROPS,
    float_precision: str | None = None,
) -> Int8Engine:
    """The int8 engine for a trained model (what the precision gate and ``predict --precision int8`` call):
    checked (:func:`check_int8`), calibrated on ``count`` of its run's training crops, quantized once; its
    float layers at ``float_precision`` (default :func:`float_layers_precision`, this CPU's)."""
    check_int8(engine)
    precision = float_layers_precision() if float_precision is None else float_precision
    return Int8Engine(source.model_path, calibration_from_run(source, count), precision)
