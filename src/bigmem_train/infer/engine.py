"""Inference engines: a trained model that maps a (1, X, Y, Z, C) float32 volume to (1, X, Y, Z, K)
probabilities at any shape whose edges 2**depth divides.

``tensorflow``: the saved model rebuilt with free spatial dimensions (same layers, same weights) and
called through ``tf.function``: one graph per input shape, run by TensorFlow's executor, which frees each
layer's output once its consumers have run (Keras' eager call would keep every output to the end: 3x the
memory at the study's volume, measured in docs/results/inference.md). oneDNN kernels as in training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bigmem_train.errors import BadInput

ENGINES = ("tensorflow",)


class TensorFlowEngine:
    """The saved Keras model, shape-free, called in graph mode (one trace per input shape)."""

    name = "tensorflow"

    def __init__(self, model_path: Path):
        import keras
        import tensorflow as tf

        import bigmem_train.model.unet  # noqa: F401  (registers the kit's layers the archive names)

        try:
            saved = keras.models.load_model(model_path, compile=False)
        except Exception as error:  # Keras raises many types for a damaged or foreign archive
            raise BadInput(
                f"{model_path}: cannot be loaded as a Keras model ({type(error).__name__}: {error})"
            ) from None
        config = saved.get_config()
        for layer in config["layers"]:
            if layer["class_name"] == "InputLayer":
                shape = layer["config"]["batch_shape"]
                layer["config"]["batch_shape"] = [None, None, None, None, shape[-1]]
        model = keras.Model.from_config(config)
        model.set_weights(saved.get_weights())
        del saved
        self.model = model
        self._forward = tf.function(lambda volume: model(volume, training=False), reduce_retracing=False)
        self._tf = tf

    def __call__(self, volume: np.ndarray) -> np.ndarray:
        result = self._forward(self._tf.constant(volume))
        return result.numpy()


def make_engine(name: str, model_path: Path):
    if name == "tensorflow":
        return TensorFlowEngine(model_path)
    raise BadInput(f"--engine {name}: use one of {', '.join(ENGINES)}")
