"""The FLOP counter (memory/flops.py) on a tiny U-Net counted by hand, on the layer table Keras builds for it,
and against TensorFlow's own profiler count of the forward convolutions."""

from __future__ import annotations

import pytest

from bigmem_train.config import Config, ModelConfig
from bigmem_train.memory import flops
from tests.fixtures.layer_records import layer_row

# The tiny U-Net: depth 1, 2 base filters, 1 input channel, 1 class, at 8x8x8 (512 voxels; 64 below the pool).
TINY = ModelConfig(depth=1, base_filters=2, batch_norm=False)
SHAPE = (8, 8, 8)


def tiny_table(folded: bool) -> list[dict]:
    """The tiny U-Net's layer table as memory.layers records it (ReLUs only where a layer reads them)."""
    table = [
        layer_row("volume", "InputLayer", [], 1, 1),
        layer_row("down0_conv1", "Conv3D", ["volume"], 1, 2, (3, 3, 3), 56),
        layer_row("down0_conv2", "Conv3D", ["down0_conv1"], 1, 2, (3, 3, 3), 110),
        layer_row("pool0", "MaxPooling3D", ["down0_conv2"], 2, 2),
        layer_row("bottom_conv1", "Conv3D", ["pool0"], 2, 4, (3, 3, 3), 220),
        layer_row("bottom_conv2", "Conv3D", ["bottom_conv1"], 2, 4, (3, 3, 3), 436),
    ]
    if folded:
        table.append(layer_row("up0_conv1", "FoldedUpConv", ["bottom_conv2", "down0_conv2"], 1, 2, (), 284))
    else:
        table += [
            layer_row("up0_transpose", "Conv3DTranspose", ["bottom_conv2"], 1, 2, (2, 2, 2), 66),
            layer_row("up0_concat", "Concatenate", ["up0_transpose", "down0_conv2"], 1, 4),
            layer_row("up0_conv1", "Conv3D", ["up0_concat"], 1, 2, (3, 3, 3), 218),
        ]
    table += [
        layer_row("up0_conv2", "Conv3D", ["up0_conv1"], 1, 2, (3, 3, 3), 110),
        layer_row("segmentation", "Conv3D", ["up0_conv2"], 1, 1, (1, 1, 1), 3),
    ]
    return table


# Multiply-adds of one 8x8x8 sample, layer by layer: voxels x taps x input channels x output channels.
DOWN0_CONV1 = 512 * 27 * 1 * 2  # 27,648
DOWN0_CONV2 = 512 * 27 * 2 * 2  # 55,296
BOTTOM_CONV1 = 64 * 27 * 2 * 4  # 13,824 ('same' padding: 4x4x4 out of 4x4x4 in)
BOTTOM_CONV2 = 64 * 27 * 4 * 4  # 27,648
UP0_TRANSPOSE = 64 * 8 * 4 * 2  # 4,096: each of 64 input voxels scatters 2x2x2 taps
UP0_CONV1 = 512 * 27 * 4 * 2  # 110,592: the concatenation's 4 channels
UP0_CONV2 = 512 * 27 * 2 * 2  # 55,296
SEGMENTATION = 512 * 1 * 2 * 1  # 1,024
# Folded (upconv.py): 64 low voxels x 64 taps x (4 channels + the ones channel) x 2, and the skip's
# 2 channels convolved at full resolution: 40,960 + 55,296.
FOLDED_UP = 64 * 64 * 5 * 2
FOLDED_SKIP = 512 * 27 * 2 * 2

UNFOLDED_MACS = (
    DOWN0_CONV1
    + DOWN0_CONV2
    + BOTTOM_CONV1
    + BOTTOM_CONV2
    + UP0_TRANSPOSE
    + UP0_CONV1
    + UP0_CONV2
    + SEGMENTATION
)
FOLDED_MACS = UNFOLDED_MACS - UP0_TRANSPOSE - UP0_CONV1 + FOLDED_UP + FOLDED_SKIP


def test_the_hand_count_adds_up():
    assert UNFOLDED_MACS == 295_424
    assert FOLDED_MACS == 276_992


@pytest.mark.parametrize("folded, macs", [(False, UNFOLDED_MACS), (True, FOLDED_MACS)])
def test_forward_is_two_flops_per_multiply_add(folded, macs):
    table = tiny_table(folded)
    assert flops.forward_flops(table, SHAPE) == 2 * macs  # 590,848 unfolded
    assert flops.forward_flops(table, SHAPE, batch=3) == 3 * 2 * macs


@pytest.mark.parametrize("folded, macs", [(False, UNFOLDED_MACS), (True, FOLDED_MACS)])
def test_a_training_step_is_three_forwards_less_the_first_input_gradient(folded, macs):
    """Forward, input gradient and filter gradient each cost the forward; the first convolution reads the
    model's input, whose gradient nobody asks for."""
    expected = 3 * 2 * macs - 2 * DOWN0_CONV1  # 1,717,248 unfolded
    assert flops.training_step_flops(tiny_table(folded), SHAPE, batch=1) == expected
    assert flops.training_step_flops(tiny_table(folded), SHAPE, batch=2) == 2 * expected


def test_each_layer_and_its_gradients():
    layers = {layer.name: layer for layer in flops.layer_flops(tiny_table(False), SHAPE)}
    assert list(layers) == [
        "down0_conv1",
        "down0_conv2",
        "bottom_conv1",
        "bottom_conv2",
        "up0_transpose",
        "up0_conv1",
        "up0_conv2",
        "segmentation",
    ]
    first = layers["down0_conv1"]
    assert (first.forward, first.input_gradient, first.filter_gradient) == (
        2 * DOWN0_CONV1,
        0,
        2 * DOWN0_CONV1,
    )
    bottom = layers["bottom_conv1"]
    assert bottom.output_shape == (4, 4, 4) and (bottom.input_channels, bottom.output_channels) == (2, 4)
    assert bottom.training == 3 * 2 * BOTTOM_CONV1
    assert layers["up0_transpose"].forward == 2 * UP0_TRANSPOSE
    assert layers["up0_conv1"].input_channels == 4
    folded = {layer.name: layer for layer in flops.layer_flops(tiny_table(True), SHAPE)}["up0_conv1"]
    assert folded.forward == folded.input_gradient == folded.filter_gradient == 2 * (FOLDED_UP + FOLDED_SKIP)


def test_a_volume_the_pooling_cannot_halve_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        flops.forward_flops(tiny_table(False), (8, 8, 9))


def _keras_table(model_config: ModelConfig) -> list[dict]:
    pytest.importorskip("tensorflow")
    from bigmem_train.memory import layers

    return layers.layer_table_from_keras(Config(model=model_config, data={"channels": [0]}))


def test_the_models_own_layer_table_counts_as_the_hand_table():
    """The table Keras records for the tiny U-Net (batch norm and ReLU rows included) counts the same."""
    table = _keras_table(TINY.model_copy(update={"fold_upsampling": False}))
    assert flops.forward_flops(table, SHAPE) == 2 * UNFOLDED_MACS
    assert flops.training_step_flops(table, SHAPE, 1) == 3 * 2 * UNFOLDED_MACS - 2 * DOWN0_CONV1
    with_norm = _keras_table(TINY.model_copy(update={"fold_upsampling": False, "batch_norm": True}))
    assert flops.forward_flops(with_norm, SHAPE) == 2 * UNFOLDED_MACS


def test_recompute_adds_one_forward_of_every_block():
    plain = _keras_table(TINY.model_copy(update={"fold_upsampling": False}))
    recomputed = _keras_table(TINY.model_copy(update={"recompute": True}))
    # Every convolution but the 1x1x1 output sits in a recomputed block.
    again = 2 * (UNFOLDED_MACS - SEGMENTATION)
    assert (
        flops.training_step_flops(recomputed, SHAPE, 1) == flops.training_step_flops(plain, SHAPE, 1) + again
    )


def test_tensorflows_profiler_counts_the_same_forward():
    """TensorFlow's registered count of Conv3D (output voxels x taps x input channels x 2) over the
    forward graph; resize upsampling, so that every multiply-add layer is a Conv3D the profiler counts."""
    tf = pytest.importorskip("tensorflow")
    from bigmem_train.model.unet import build_unet

    config = TINY.model_copy(update={"upsampling": "resize"})
    model = build_unet(config, SHAPE, 1)
    graph = (
        tf.function(lambda volume: model(volume, training=False))
        .get_concrete_function(tf.TensorSpec((1, *SHAPE, 1), tf.float32))
        .graph
    )
    builder = tf.compat.v1.profiler.ProfileOptionBuilder
    options = builder(builder.float_operation()).with_empty_output().build()
    options["account_type_regexes"] = ["Conv3D"]
    profiled = tf.compat.v1.profiler.profile(graph=graph, options=options).total_float_ops
    # Resize: no transposed convolution; the decoder's conv1 reads the bottom's 4 channels upsampled plus the
    # skip's 2: 512 x 27 x 6 x 2 = 165,888 multiply-adds instead of 110,592.
    counted = flops.forward_flops(_keras_table(config), SHAPE)
    assert counted == 2 * (UNFOLDED_MACS - UP0_TRANSPOSE - UP0_CONV1 + 512 * 27 * 6 * 2)
    assert profiled == counted
