"""Inference engines: a trained model that maps a (1, X, Y, Z, C) float32 volume to (1, X, Y, Z, K)
probabilities at any shape whose edges 2**depth divides.

- ``tensorflow``: the saved model rebuilt with free spatial dimensions (same layers, same weights) and
  called through ``tf.function``: one graph per input shape, run by TensorFlow's executor, which frees each
  layer's output once its consumers have run (Keras' eager call keeps every output to the end: 3x the
  memory at the study's volume). oneDNN kernels as in training.
- ``openvino``: Intel's inference runtime (the optional ``openvino`` extra, installed in the image): the
  model exported as a SavedModel, converted once, compiled once per input shape.

``precision`` "bfloat16" computes in bfloat16 (TensorFlow: Keras' mixed_bfloat16 policy on every layer but
the float32 output; OpenVINO: its inference precision hint) and is offered where the CPU has it natively
(AMX or AVX512_BF16); "int8" is the OpenVINO model quantized by NNCF (:mod:`.int8`, made by
:func:`.predict.make_predict_engine`); "float32" is exact. The engine ``auto`` picks OpenVINO when it is
installed (the faster engine, docs/results/inference.md), else TensorFlow; the precision ``auto`` is decided
by :mod:`.precision`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bigmem_train.errors import BadInput

ENGINES = ("auto", "tensorflow", "openvino")
# The precisions predict runs; int8 is the OpenVINO model quantized by NNCF (infer/int8.py).
PRECISIONS = ("float32", "bfloat16", "int8")
# ``--precision``: a precision, or ``auto`` (the fastest native one that passes the Dice gate, precision.py).
PRECISION_CHOICES = ("auto", *PRECISIONS)
# The CPU flags that make a precision native, fastest precision first; float32 is native everywhere. int8
# needs a native int8 dot product (VNNI in AVX-512 or AVX, AMX's int8 tiles), bfloat16 AVX512_BF16 or AMX.
NATIVE_FLAGS = {
    "int8": frozenset({"avx512_vnni", "avx_vnni", "amx_int8"}),
    "bfloat16": frozenset({"amx_bf16", "avx512_bf16"}),
}
_BFLOAT16_POLICY = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "mixed_bfloat16"}}


def openvino_available() -> bool:
    return importlib.util.find_spec("openvino") is not None


def resolve_engine(name: str) -> str:
    if name not in ENGINES:
        raise BadInput(f"--engine {name}: use one of {', '.join(ENGINES)}")
    if name == "auto":
        return "openvino" if openvino_available() else "tensorflow"
    if name == "openvino" and not openvino_available():
        raise BadInput(
            "--engine openvino: OpenVINO is not installed (pip install openvino, or use the image)"
        )
    return name


def native_precisions(cpu_flags) -> list[str]:
    """The precisions faster than float32 that this CPU (its ``cpu_flags``) computes natively, fastest first."""
    flags = set(cpu_flags or ())
    return [precision for precision, needs in NATIVE_FLAGS.items() if needs & flags]


def check_precision(precision: str, cpu_flags) -> None:
    """BadInput (exit 2) for a precision this CPU cannot run (int8's engine and NNCF: ``int8.check_int8``)."""
    if precision not in PRECISION_CHOICES:
        raise BadInput(f"--precision {precision}: use one of {', '.join(PRECISION_CHOICES)}")
    if precision == "bfloat16" and precision not in native_precisions(cpu_flags):
        raise BadInput(
            "--precision bfloat16: this CPU has no native bfloat16 (AMX or AVX512_BF16); it would be emulated, "
            "slower than float32"
        )


def _load_keras(model_path: Path):
    import keras

    import bigmem_train.model.unet  # noqa: F401  (registers the kit's layers the archive names)

    try:
        return keras.models.load_model(model_path, compile=False)
    except Exception as error:  # Keras raises many types for a damaged or foreign archive
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise BadInput(f"{model_path}: cannot be loaded as a Keras model ({reason})") from None


def _shape_free(saved, precision: str):
    """The saved model rebuilt with free spatial dimensions (and bfloat16 compute), its weights copied."""
    import keras

    config = copy.deepcopy(saved.get_config())
    output_names = {entry[0] if isinstance(entry, list) else entry for entry in config["output_layers"]}
    for layer in config["layers"]:
        if layer["class_name"] == "InputLayer":
            shape = layer["config"]["batch_shape"]
            layer["config"]["batch_shape"] = [None, None, None, None, shape[-1]]
        elif precision == "bfloat16" and layer["config"].get("name") not in output_names:
            layer["config"]["dtype"] = copy.deepcopy(_BFLOAT16_POLICY)
    model = keras.Model.from_config(config)
    model.set_weights(saved.get_weights())
    return model


class TensorFlowEngine:
    """The saved Keras model, shape-free, called in graph mode (one trace per input shape)."""

    name = "tensorflow"

    def __init__(self, model_path: Path, precision: str = "float32"):
        import tensorflow as tf

        saved = _load_keras(model_path)
        model = _shape_free(saved, precision)
        del saved
        self.model = model
        self._forward = tf.function(lambda volume: model(volume, training=False), reduce_retracing=False)
        self._tf = tf

    def __call__(self, volume: np.ndarray) -> np.ndarray:
        return np.asarray(self._forward(self._tf.constant(volume)), dtype=np.float32)


class OpenVINOEngine:
    """The saved model converted to OpenVINO's format once (in a child process, cached by the model file's
    digest), then read and compiled once per input shape by a process that never imports TensorFlow: the
    runtime's baseline is OpenVINO's, not TensorFlow's."""

    name = "openvino"

    def __init__(self, model_path: Path, precision: str = "float32"):
        import openvino as ov

        self._core = ov.Core()
        # How the one-time conversion went (None: the converted model came from the cache).
        self.conversion: dict | None = None
        self._model = self._core.read_model(converted_model(model_path, self._conversion_done))
        self._hint = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bfloat16" else "f32"}
        self._compiled: dict[tuple[int, ...], object] = {}

    def _conversion_done(self, record: dict) -> None:
        self.conversion = record

    def __call__(self, volume: np.ndarray) -> np.ndarray:
        compiled = self._compiled.get(volume.shape)
        if compiled is None:
            model = self._model.clone()
            model.reshape(list(volume.shape))
            # One shape at a time: a whole volume's compiled network is dropped before another is built.
            self._compiled.clear()
            compiled = self._compiled[volume.shape] = self._core.compile_model(model, "CPU", self._hint)
        return np.asarray(compiled(volume)[0], dtype=np.float32)


def file_digest(path: Path) -> str:
    """The first 20 hex digits of the file's SHA-256: names a model's converted copy and its precision gate."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:20]


def cached_or_made(targets: Sequence[Path], make: Callable[[Path], bool], refusal: str) -> Path:
    """Each of ``targets`` in turn: the copy there if it exists, else made there by ``make`` if its folder can
    be made and written (``make`` returns False to go on to the next: a read-only mount it met); BadInput
    ``refusal`` when none is. The OpenVINO conversion and the int8 model share it."""
    for target in targets:
        if target.is_file():
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(target.parent, os.W_OK) and make(target):
            return target
    raise BadInput(refusal)


def converted_model(model_path: Path, converted: Callable[[dict], None] | None = None) -> Path:
    """OpenVINO's model.xml for a ``.keras`` file: from the cache, else converted by a child process (which
    imports TensorFlow; this one does not), whose peak resident set and time are handed to ``converted``.
    The cache is under ``cache_dir()/openvino``, or a temporary folder where that cannot be written (a
    read-only container)."""
    from bigmem_train.memory.layers import cache_dir

    def convert(target: Path) -> bool:
        print("predict: converting the model for OpenVINO (once per model)", file=sys.stderr, flush=True)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "bigmem_train.infer.engine", "--convert", str(model_path), str(target)],
            capture_output=True,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        if result.returncode == 0 and target.is_file():
            peaks = [
                line.split()[1] for line in result.stdout.splitlines() if line.startswith("peak_rss_bytes ")
            ]
            record = {
                "peak_rss_bytes": int(peaks[-1]) if peaks else None,
                "seconds": round(time.monotonic() - started, 1),
            }
            if converted is not None:
                converted(record)
            return True
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        if lines and lines[-1].startswith("BadInput: "):
            raise BadInput(lines[-1].removeprefix("BadInput: "))
        if result.returncode != 0 and not any(
            "Permission denied" in line or "Read-only" in line for line in lines
        ):
            raise BadInput(
                f"{model_path}: OpenVINO could not convert it ({lines[-1] if lines else 'no output'})"
            )
        return False

    digest = file_digest(model_path)
    roots = (cache_dir() / "openvino", Path(tempfile.gettempdir()) / "bigmem-train-openvino")
    refusal = f"{model_path}: no writable folder for OpenVINO's converted model (set BIGMEM_CACHE_DIR)"
    return cached_or_made([root / digest / "model.xml" for root in roots], convert, refusal)


def _convert(model_path: Path, target: Path) -> None:
    """In a child process: the Keras model, shape-free, exported and converted to OpenVINO's files."""
    import openvino as ov

    model = _shape_free(_load_keras(model_path), "float32")
    with tempfile.TemporaryDirectory(prefix="bigmem-openvino-") as folder:
        model.export(folder, format="tf_saved_model", verbose=False)
        converted = ov.convert_model(folder)
    partial = target.with_name(".partial-" + target.name)
    ov.save_model(converted, partial, compress_to_fp16=False)
    partial.with_suffix(".bin").replace(target.with_suffix(".bin"))
    partial.replace(target)


def make_engine(name: str, model_path: Path, precision: str = "float32"):
    name = resolve_engine(name)
    return (OpenVINOEngine if name == "openvino" else TensorFlowEngine)(model_path, precision)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--convert":
        try:
            _convert(Path(sys.argv[2]), Path(sys.argv[3]))
        except BadInput as error:
            sys.exit(f"BadInput: {error}")
        # The conversion's own peak, for predict.json (this process's VmHWM, not its parent's).
        from bigmem_train.train.monitor import peak_rss_bytes

        print(f"peak_rss_bytes {peak_rss_bytes()}", flush=True)
    else:
        sys.exit("usage: python -m bigmem_train.infer.engine --convert MODEL.keras OUT/model.xml")
