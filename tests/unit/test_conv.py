"""The chunked Conv3D (conv.py): oneDNN's gemm scratchpad limit, and the same mathematics as Conv3D."""

import numpy as np
import pytest

from bigmem_train.model.conv import (
    ConvGeometry,
    gemm_backward_weights_fits,
    gemm_backward_weights_scratchpad_bytes,
    plan_depth_chunk,
    slab_geometry,
)


@pytest.mark.parametrize(
    ("spatial", "cin", "cout", "fits"),
    [
        # What oneDNN 3.7 created for the filter gradient on the AVX2 machine of issue 14 (ONEDNN_VERBOSE=2).
        ((240, 240, 144), 16, 16, True),
        ((240, 240, 144), 16, 32, True),
        ((240, 120, 144), 32, 16, True),
        ((240, 240, 72), 32, 16, True),
        ((192, 192, 144), 32, 16, True),
        ((160, 160, 144), 32, 16, True),
        ((128, 128, 128), 32, 16, True),
        ((240, 240, 144), 32, 16, False),
        ((240, 240, 144), 32, 32, False),
        # The boundary in depth at 240x144 in-plane, 32 -> 16 (also probed: tests/integration/test_onednn_cliff.py).
        ((215, 240, 144), 32, 16, True),
        ((216, 240, 144), 32, 16, False),
    ],
)
def test_gemm_limit_reproduces_onednn_decisions(spatial, cin, cout, fits):
    assert gemm_backward_weights_fits(ConvGeometry(spatial, cin, cout)) is fits


def test_scratchpad_is_the_three_bookings():
    geometry = ConvGeometry((240, 240, 144), 32, 16)
    im2col = 32 * 27 * 240 * 144 * 4
    transposed_input = 32 * 240 * 240 * 144 * 4
    reduction = 4 * (4 * 16 * 32 * 27)
    assert gemm_backward_weights_scratchpad_bytes(geometry) == im2col + transposed_input + reduction + 3 * 128
    # Several threads each book their own copies (only when oneDNN threads over a batch of samples).
    assert (
        gemm_backward_weights_scratchpad_bytes(geometry, 2)
        == 2 * (im2col + transposed_input + reduction) + 3 * 128
    )


def test_depth_chunk_is_the_fewest_equal_chunks_under_the_limit():
    geometry = ConvGeometry((240, 240, 144), 32, 16)
    chunk = plan_depth_chunk(geometry)
    assert chunk == 120  # two chunks; each slab is 122 planes (the 3x3x3 window's halo)
    assert slab_geometry(geometry, chunk).spatial == (122, 240, 144)
    assert gemm_backward_weights_fits(slab_geometry(geometry, chunk))
    assert plan_depth_chunk(ConvGeometry((240, 240, 144), 16, 16)) is None  # fits whole: not chunked
    with pytest.raises(ValueError, match="one output plane"):
        plan_depth_chunk(ConvGeometry((64, 4096, 4096), 32, 16))


def _plain_gradients(x, kernel, dy, padding):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch([x, kernel])
        y = tf.nn.conv3d(x, kernel, strides=[1] * 5, padding=padding.upper())
    return tape.gradient(y, [x, kernel], output_gradients=dy)


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("kernel_depth", [3, 2])
def test_chunked_gradients_equal_tensorflows(padding, kernel_depth):
    """Every chunk size from one plane to one short of the whole depth, including a last chunk shorter than
    the others, with the volume's padding at both ends, and an even kernel (asymmetric halo)."""
    import tensorflow as tf

    from bigmem_train.model.conv import chunked_conv3d

    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((2, 7, 5, 4, 3)), tf.float32)
    kernel = tf.constant(rng.standard_normal((kernel_depth, 3, 3, 3, 4)), tf.float32)
    out_depth = 7 if padding == "same" else 7 - kernel_depth + 1
    plane = (5, 4) if padding == "same" else (3, 2)
    dy = tf.constant(rng.standard_normal((2, out_depth, *plane, 4)), tf.float32)
    plain_dx, plain_dw = _plain_gradients(x, kernel, dy, padding)
    for chunk in range(1, out_depth):

        @tf.function
        def chunked(x, kernel, chunk=chunk):
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                y = chunked_conv3d(x, kernel, padding, chunk)
            return y, tape.gradient(y, [x, kernel], output_gradients=dy)

        y, (dx, dw) = chunked(x, kernel)
        np.testing.assert_allclose(y, tf.nn.conv3d(x, kernel, [1] * 5, padding.upper()), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dx, plain_dx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, plain_dw, rtol=1e-5, atol=1e-5, err_msg=f"chunk {chunk}")


def test_chunked_layer_is_conv3d_and_saves(tmp_path):
    """ChunkedConv3D with a lowered limit chunks a small volume, matches keras' Conv3D (outputs, kernel,
    bias and input gradients) in a compiled step, and round-trips through a .keras file."""
    import keras
    import tensorflow as tf

    from bigmem_train.model.conv import ChunkedConv3D

    limit = gemm_backward_weights_scratchpad_bytes(ConvGeometry((3, 6, 5), 4, 3))
    chunked = ChunkedConv3D(3, 3, padding="same", scratchpad_limit_bytes=limit, name="conv")
    plain = keras.layers.Conv3D(3, 3, padding="same", name="conv")
    inputs = keras.Input((9, 6, 5, 4))
    models = [keras.Model(inputs, layer(inputs)) for layer in (chunked, plain)]
    assert chunked.depth_chunk((2, 9, 6, 5, 4)) == 1
    plain.set_weights(chunked.get_weights())

    x = tf.constant(np.random.default_rng(2).standard_normal((2, 9, 6, 5, 4)), tf.float32)

    @tf.function
    def step(model, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x, *model.trainable_weights])

    (y_chunked, grads_chunked), (y_plain, grads_plain) = step(models[0], x), step(models[1], x)
    np.testing.assert_allclose(y_chunked, y_plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads_chunked, grads_plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)

    path = tmp_path / "chunked.keras"
    models[0].save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.get_layer("conv")
    assert type(layer) is ChunkedConv3D and layer.scratchpad_limit_bytes == limit
    np.testing.assert_allclose(loaded(x), y_chunked, rtol=1e-6)


def test_chunked_layer_trains_under_a_distribution_strategy_like_conv3d():
    """One SGD step under tf.distribute (the path multi-worker training takes: per-replica gradients,
    all-reduced, applied): the chunked model ends with the same weights as the plain one."""
    import keras
    import tensorflow as tf

    from bigmem_train.model.conv import ChunkedConv3D

    limit = gemm_backward_weights_scratchpad_bytes(ConvGeometry((4, 6, 5), 2, 3))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 10, 6, 5, 2)).astype(np.float32)
    y = rng.standard_normal((4, 10, 6, 5, 3)).astype(np.float32)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    models = []
    with strategy.scope():
        for layer in (
            ChunkedConv3D(3, 3, padding="same", scratchpad_limit_bytes=limit, name="conv"),
            keras.layers.Conv3D(3, 3, padding="same", name="conv"),
        ):
            inputs = keras.Input((10, 6, 5, 2))
            model = keras.Model(inputs, layer(inputs))
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            models.append(model)
    assert models[0].get_layer("conv").depth_chunk((4, 10, 6, 5, 2)) == 2
    models[1].set_weights(models[0].get_weights())
    initial_kernel = models[0].get_weights()[0]
    for model in models:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for chunked, plain in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(chunked, plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(models[0].get_weights()[0], initial_kernel)  # the step did change the kernel


def test_the_planner_prices_the_slabs_a_chunked_filter_gradient_copies(monkeypatch):
    from bigmem_train.memory import estimate
    from bigmem_train.model.conv_geometry import chunk_copy_bytes
    from tests.fixtures.common import recorded_layer_table

    # The study's tile: up0_conv1 (32 -> 16 channels on 240x240x144, TensorFlow's D x H x W) runs as two
    # chunks of 120 output planes; one chunk copies a 122-plane input slab (halo included) and pads its
    # output gradient to 122 planes.
    tile = ConvGeometry((240, 240, 144), 32, 16)
    assert plan_depth_chunk(tile) == 120
    assert chunk_copy_bytes(tile, 1) == 122 * 240 * 144 * (32 + 16) * 4
    assert chunk_copy_bytes(tile, 3) == 3 * chunk_copy_bytes(tile, 1)
    assert chunk_copy_bytes(ConvGeometry((240, 240, 144), 16, 16), 1) == 0  # not chunked
    # In the backward walk, at that layer only, on a CPU whose filter gradient runs gemm (and so is chunked).
    monkeypatch.setattr(estimate, "onednn_uses_gemm_backward_weights", lambda: True)
    table = recorded_layer_table("unet_depth4_filters16_float32")
    rows = {row["name"]: row for row in table}
    priced = {row["name"] for row in table if estimate._chunk_copies(row, rows, 1, (240, 240, 144))}
    assert priced == {"up0_conv1"}
    assert not any(estimate._chunk_copies(row, rows, 1, (128, 224, 224)) for row in table)
    # With AVX-512 the model does not chunk (no gemm limit there), and nothing is priced.
    monkeypatch.setattr(estimate, "onednn_uses_gemm_backward_weights", lambda: False)
    assert not any(estimate._chunk_copies(row, rows, 1, (240, 240, 144)) for row in table)


def test_the_model_chunks_only_where_onednn_runs_the_gemm_filter_gradient(monkeypatch):
    from bigmem_train.model import conv
    from bigmem_train.model.conv_geometry import filter_gradient_runs_gemm

    avx512 = ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"]
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert filter_gradient_runs_gemm(["avx2", "fma"]) and not filter_gradient_runs_gemm(avx512)
    for cap, gemm in (("AVX2", True), ("avx2_vnni", True), ("AVX512_CORE", False), ("ALL", False)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert filter_gradient_runs_gemm(avx512) is gemm, cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    # The study's first full-resolution decoder convolution: chunked on a gemm CPU, whole with AVX-512.
    for gemm, kind in ((True, "ChunkedConv3D"), (False, "Conv3D")):
        monkeypatch.setattr(conv, "filter_gradient_runs_gemm", lambda gemm=gemm: gemm)
        assert type(conv.conv3d_for((1, 240, 240, 144, 32), 16)).__name__ == kind
        # A recomputed block builds ChunkedConv3D before it knows its input: the layer decides the same.
        layer = conv.ChunkedConv3D(16, 3, padding="same")
        assert layer.depth_chunk((1, 240, 240, 144, 32)) == (120 if gemm else None)
        # A limit set by hand (the tests' small volumes) chunks on any CPU.
        small = conv.ChunkedConv3D(4, 3, padding="same", scratchpad_limit_bytes=320_000)
        assert small.depth_chunk((1, 16, 16, 16, 8)) is not None
