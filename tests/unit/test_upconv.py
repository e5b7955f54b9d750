"""FoldedUpConv (upconv.py) against the layers it folds: Conv3DTranspose -> Concatenate -> Conv3D."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from bigmem_train.config import ModelConfig  # noqa: E402
from bigmem_train.model import upconv  # noqa: E402
from bigmem_train.model.unet import build_unet  # noqa: E402
from bigmem_train.model.upconv import FoldedUpConv  # noqa: E402


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-12))


def _unfolded(filters: int, use_bias: bool):
    transpose = keras.layers.Conv3DTranspose(filters, 2, strides=2, padding="same")
    concat = keras.layers.Concatenate(axis=-1)
    conv = keras.layers.Conv3D(filters, 3, padding="same", use_bias=use_bias)

    def apply(x, skip):
        return conv(concat([transpose(x), skip]))

    return apply, transpose, conv


@pytest.mark.parametrize("use_bias", [False, True])
def test_folded_layer_equals_transpose_concat_conv(use_bias):
    """Odd, non-cubic edges, batch 2, skip channels unlike the filters: outputs and the gradients of both
    inputs and of every weight equal the unfolded layers' (random weights and biases, borders included)."""
    rng = np.random.default_rng(1)
    filters, low_channels, skip_channels = 3, 5, 4
    x = tf.constant(rng.standard_normal((2, 3, 5, 4, low_channels)), tf.float32)
    skip = tf.constant(rng.standard_normal((2, 6, 10, 8, skip_channels)), tf.float32)
    weight = tf.constant(rng.standard_normal((2, 6, 10, 8, filters)), tf.float32)
    apply, transpose, conv = _unfolded(filters, use_bias)
    reference = apply(x, skip)
    folded = FoldedUpConv(filters, use_bias=use_bias)
    folded([x, skip])
    transpose.bias.assign(rng.standard_normal(filters).astype(np.float32))
    folded.transpose_kernel.assign(transpose.kernel)
    folded.transpose_bias.assign(transpose.bias)
    folded.kernel.assign(conv.kernel)
    if use_bias:
        conv.bias.assign(rng.standard_normal(filters).astype(np.float32))
        folded.bias.assign(conv.bias)

    def gradients(run, variables):
        with tf.GradientTape() as tape:
            tape.watch([x, skip])
            out = run()
            loss = tf.reduce_sum(out * weight)
        return out, tape.gradient(loss, [x, skip, *variables])

    ref_vars = [transpose.kernel, transpose.bias, conv.kernel] + ([conv.bias] if use_bias else [])
    fold_vars = [folded.transpose_kernel, folded.transpose_bias, folded.kernel] + (
        [folded.bias] if use_bias else []
    )
    ref_out, ref_grads = gradients(lambda: apply(x, skip), ref_vars)
    fold_out, fold_grads = gradients(lambda: folded([x, skip]), fold_vars)
    assert fold_out.shape == ref_out.shape == (2, 6, 10, 8, filters)
    assert _relative(ref_out, fold_out) < 1e-5
    assert _relative(reference, ref_out) > 0.01  # the transposed bias, set after the first call, counts
    for name, a, b in zip(
        ["x", "skip", "transpose kernel", "transpose bias", "kernel", "bias"], ref_grads, fold_grads
    ):
        assert _relative(a, b) < 1e-5, name


def _copy_unfolded_weights(unfolded, folded):
    """Give the folded model the unfolded model's weights (the folded levels' three tensors by name)."""
    for layer in folded.layers:
        if isinstance(layer, FoldedUpConv):
            level = layer.name.split("_")[0]
            source_t = unfolded.get_layer(f"{level}_transpose")
            layer.transpose_kernel.assign(source_t.kernel)
            layer.transpose_bias.assign(source_t.bias + 0.1)  # nonzero, so the folded bias is exercised
            source_t.bias.assign(source_t.bias + 0.1)
            layer.kernel.assign(unfolded.get_layer(layer.name).kernel)
        elif layer.weights:
            for target, source in zip(layer.weights, unfolded.get_layer(layer.name).weights):
                target.assign(source)


def test_a_cpu_that_does_not_fold_builds_the_unfolded_model(monkeypatch):
    from bigmem_train.model import conv

    monkeypatch.setattr(conv, "filter_gradient_runs_gemm", lambda *args: True)  # an AVX2 CPU's kernel
    assert not upconv.fold_available()
    folded = build_unet(ModelConfig(depth=3, base_filters=4, fold_upsampling=True), (32, 24, 16), 2)
    assert not any(isinstance(layer, FoldedUpConv) for layer in folded.layers)


def test_folded_model_trains_like_the_unfolded_one(monkeypatch):
    """The U-Net with fold_upsampling: the two shallowest decoder levels are FoldedUpConv, and its output and
    loss gradients equal the unfolded model's with the same weights. Built as on a CPU that folds (AVX-512)
    whatever this one has: at this size no kernel's scratchpad limit is near."""
    from bigmem_train.model import conv

    monkeypatch.setattr(conv, "filter_gradient_runs_gemm", lambda *args: False)
    # Seeded: with four filters an unlucky draw leaves a channel all but dead after its ReLU, and the next batch
    # normalization's tiny variance magnifies float32 rounding in the gradients upstream of it (one CI run saw 5e-3
    # on down0_conv1's kernel; seeds 0-11 here give 3e-6 to 2e-5, on AVX-512 and on AVX2 alike).
    keras.utils.set_random_seed(0)
    shape, channels = (32, 24, 16), 2
    plain = build_unet(ModelConfig(depth=3, base_filters=4, fold_upsampling=False), shape, channels)
    folded = build_unet(ModelConfig(depth=3, base_filters=4, fold_upsampling=True), shape, channels)
    folded_layers = sorted(layer.name for layer in folded.layers if isinstance(layer, FoldedUpConv))
    assert folded_layers == ["up0_conv1", "up1_conv1"]
    assert "up2_transpose" in [layer.name for layer in folded.layers]  # the deepest level stays unfolded
    assert folded.count_params() == plain.count_params()
    _copy_unfolded_weights(plain, folded)
    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((2, *shape, channels)), tf.float32)
    target = tf.constant(rng.random((2, *shape, 1)) > 0.9, tf.float32)

    def run(model):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.binary_crossentropy(target, out))
        grads = dict(
            zip([v.path for v in model.trainable_variables], tape.gradient(loss, model.trainable_variables))
        )
        return out, grads

    plain_out, plain_grads = run(plain)
    folded_out, folded_grads = run(folded)
    assert _relative(plain_out, folded_out) < 1e-4
    for path, grad in folded_grads.items():
        level, _, weight = path.partition("/")
        if weight == "transpose_kernel":
            source = plain_grads[f"{level.split('_')[0]}_transpose/kernel"]
        elif weight == "transpose_bias":
            source = plain_grads[f"{level.split('_')[0]}_transpose/bias"]
        else:
            source = plain_grads[path]
        assert _relative(source, grad) < 1e-3, path


def test_folded_layer_round_trips_and_runs_in_bfloat16(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 4, 2, 6)).astype(np.float32)
    skip = rng.standard_normal((1, 8, 8, 4, 3)).astype(np.float32)
    inputs = [keras.Input((4, 4, 2, 6)), keras.Input((8, 8, 4, 3))]
    model = keras.Model(inputs, FoldedUpConv(3, name="up0_conv1")(inputs))
    path = tmp_path / "folded.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert np.array_equal(model.predict([x, skip], verbose=0), loaded.predict([x, skip], verbose=0))
    mixed = FoldedUpConv(3, dtype="mixed_bfloat16")
    out = mixed([tf.constant(x), tf.constant(skip)])
    assert out.dtype == tf.bfloat16
    full = FoldedUpConv(3)
    full([tf.constant(x), tf.constant(skip)])
    for target, source in zip(full.weights, mixed.weights):
        target.assign(source)
    assert _relative(full([tf.constant(x), tf.constant(skip)]), tf.cast(out, tf.float32)) < 0.05
