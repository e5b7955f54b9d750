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
(AMX or AVX512_BF16); "float32" is exact. ``auto`` picks OpenVINO when it is installed (the faster engine,
docs/results/inference.md), else TensorFlow.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
from pathlib import Path

import numpy as np

from bigmem_train.errors import BadInput

ENGINES = ("auto", "tensorflow", "openvino")
PRECISIONS = ("float32", "bfloat16")
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


def check_precision(precision: str, cpu_flags) -> None:
    if precision not in PRECISIONS:
        raise BadInput(f"--precision {precision}: use one of {', '.join(PRECISIONS)}")
    flags = set(cpu_flags or ())
    if precision == "bfloat16" and not {"amx_bf16", "avx512_bf16"} & flags:
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
    """The saved model converted by OpenVINO once and compiled for each input shape it meets."""

    name = "openvino"

    def __init__(self, model_path: Path, precision: str = "float32"):
        import openvino as ov

        saved = _load_keras(model_path)
        model = _shape_free(saved, "float32")
        del saved
        with tempfile.TemporaryDirectory(prefix="bigmem-openvino-") as folder:
            model.export(folder, format="tf_saved_model", verbose=False)
            self._model = ov.convert_model(folder)
        del model
        self._core = ov.Core()
        self._hint = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bfloat16" else "f32"}
        self._compiled: dict[tuple[int, ...], object] = {}

    def __call__(self, volume: np.ndarray) -> np.ndarray:
        compiled = self._compiled.get(volume.shape)
        if compiled is None:
            model = self._model.clone()
            model.reshape(list(volume.shape))
            # One shape at a time: a whole volume's compiled network is dropped before another is built.
            self._compiled.clear()
            compiled = self._compiled[volume.shape] = self._core.compile_model(model, "CPU", self._hint)
        return np.asarray(compiled(volume)[0], dtype=np.float32)


def make_engine(name: str, model_path: Path, precision: str = "float32"):
    name = resolve_engine(name)
    return (OpenVINOEngine if name == "openvino" else TensorFlowEngine)(model_path, precision)
