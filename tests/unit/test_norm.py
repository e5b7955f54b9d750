"""Fused batch normalization (norm.py): Keras 3's layer, computed by TensorFlow's fused kernel in training,
with the same outputs, gradients and moving statistics, and Keras' own code wherever it cannot fuse."""

import numpy as np
import pytest

from bigmem_train.model.norm import FusedBatchNormalization


def pair(shape, dtype_policy=None, **kwargs):
    """A Keras BatchNormalization and a FusedBatchNormalization with the same (non-trivial) weights."""
    import keras

    rng = np.random.default_rng(1)
    channels = shape[-1]
    layers = []
    for cls in (keras.layers.BatchNormalization, FusedBatchNormalization):
        layer = cls(momentum=0.9, dtype=dtype_policy, **kwargs)
        layer.build(shape)
        layers.append(layer)
    weights = [
        rng.uniform(0.5, 1.5, channels).astype(np.float32),  # gamma
        rng.standard_normal(channels).astype(np.float32),  # beta
        rng.standard_normal(channels).astype(np.float32),  # moving mean
        rng.uniform(0.5, 2.0, channels).astype(np.float32),  # moving variance
    ]
    for layer in layers:
        if layer.center and layer.scale:
            layer.set_weights(weights)
    return layers


def forward_backward(layer, x, upstream, training=True):
    import tensorflow as tf

    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    return [np.asarray(y, np.float32), *(np.asarray(g, np.float32) for g in grads)]


@pytest.mark.parametrize("shape", [(2, 6, 5, 4, 3), (1, 7, 3, 5, 8), (3, 4, 6, 2)])
def test_training_pass_equals_keras(shape):
    """Outputs, input/gamma/beta gradients and the updated moving statistics agree with Keras' layer (5-D,
    odd sizes, batch > 1, and 4-D), over two steps so the moving averages compound."""
    rng = np.random.default_rng(2)
    keras_bn, fused = pair(shape)
    for _ in range(2):
        x = (rng.standard_normal(shape) * 3 + 1.5).astype(np.float32)
        upstream = rng.standard_normal(shape).astype(np.float32)
        want = forward_backward(keras_bn, x, upstream)
        got = forward_backward(fused, x, upstream)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(fused.moving_mean), np.asarray(keras_bn.moving_mean), rtol=1e-5)
        np.testing.assert_allclose(
            np.asarray(fused.moving_variance), np.asarray(keras_bn.moving_variance), rtol=1e-5
        )


def test_training_runs_the_fused_kernel():
    """The speed comes from TensorFlow's fused ops; a refactor that silently fell back would lose it."""
    import tensorflow as tf

    _, fused = pair((1, 4, 4, 4, 2))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fused(x, training=True)
        return tape.gradient(y, x)

    graph = step.get_concrete_function(tf.TensorSpec((1, 4, 4, 4, 2), tf.float32)).graph
    kinds = {op.type for op in graph.get_operations()}
    assert "FusedBatchNormV3" in kinds and "FusedBatchNormGradV3" in kinds
    assert "Mean" not in kinds  # not Keras' moments


def test_inference_and_unfusable_layers_are_keras_own_code():
    """Validation uses the moving statistics exactly as Keras does; a layer the kernel cannot run (no
    ``center``) gives Keras' results in training."""
    rng = np.random.default_rng(3)
    shape = (2, 5, 4, 3, 4)
    x = rng.standard_normal(shape).astype(np.float32)
    upstream = rng.standard_normal(shape).astype(np.float32)
    keras_bn, fused = pair(shape)
    for a, b in zip(
        forward_backward(fused, x, upstream, training=False),
        forward_backward(keras_bn, x, upstream, training=False),
    ):
        np.testing.assert_array_equal(a, b)
    keras_bn, fused = pair(shape, center=False)
    assert not fused._fusable(x, None)
    for a, b in zip(forward_backward(fused, x, upstream), forward_backward(keras_bn, x, upstream)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_mixed_bfloat16_matches_keras():
    """Under mixed_bfloat16 both compute in float32 from the bfloat16 input and return bfloat16."""
    rng = np.random.default_rng(4)
    shape = (2, 4, 6, 4, 3)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    upstream = rng.standard_normal(shape).astype(np.float32)
    keras_bn, fused = pair(shape, dtype_policy="mixed_bfloat16")
    assert fused.compute_dtype == "bfloat16"
    import tensorflow as tf

    x_bf16 = np.asarray(tf.cast(x, tf.bfloat16))
    got, want = forward_backward(fused, x_bf16, upstream), forward_backward(keras_bn, x_bf16, upstream)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-2, atol=1e-2)  # one bfloat16 rounding
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(fused.moving_mean), np.asarray(keras_bn.moving_mean), rtol=1e-4)


def test_round_trips_through_a_keras_file(tmp_path):
    import keras

    inputs = keras.Input((4, 4, 4, 2))
    outputs = FusedBatchNormalization(momentum=0.9, name="bn")(inputs)
    model = keras.Model(inputs, outputs)
    model.get_layer("bn").set_weights([np.full(2, 1.5, np.float32), np.ones(2, np.float32)] * 2)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.get_layer("bn")) is FusedBatchNormalization
    assert loaded.get_layer("bn").momentum == 0.9
    x = np.random.default_rng(5).standard_normal((1, 4, 4, 4, 2)).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
