"""Floating-point operations of the U-Net's training step and of a predict, counted from the layer table.

Two FLOPs per multiply-add, the dense count TensorFlow's profiler gives a convolution (every output voxel
times the whole kernel, the 'same' padding's zeros included): what the kernels execute, so the count against
a measured time is a rate comparable with a matrix product's. Only the layers that multiply and add
(Conv3D, Conv3DTranspose, FoldedUpConv) are counted; batch normalization, ReLU, pooling, concatenation, the
loss and Adam are elementwise, a few FLOPs per element, under 1 % of a step at 16 filters.

Per convolution of forward cost F per sample, the backward pass costs F for the input gradient and F for the
filter gradient; a layer whose input is the model's input (the first convolution) needs no input gradient,
and TensorFlow prunes it. ``FoldedUpConv`` (upconv.py) is what it runs: a stride-2 transposed convolution
of 4x4x4 taps on the level below plus a ones channel, and a 3x3x3 convolution of the skip; the folded
kernel's own 216 small products per step (under 1e-5 of a step) are left out. With ``model.recompute`` each
recomputed layer's forward runs once more during backward.

Reads the layer table only (``layers``, beside it): no TensorFlow at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bigmem_train.config import Config
from bigmem_train.memory import layers

# Layer kinds that multiply and add; every other kind of the table counts zero.
CONVOLUTIONS = ("Conv3D", "ChunkedConv3D", "Conv3DTranspose", "FoldedUpConv")
# FoldedUpConv's transposed convolution: 4 taps per axis, stride 2 (upconv.py).
FOLDED_TAPS = 4**3


@dataclass(frozen=True)
class LayerFlops:
    """One multiply-add layer's FLOPs per sample: forward, input gradient and filter gradient."""

    name: str
    kind: str
    # Output voxels per sample and input / output channels, for timing the layer alone at its shape.
    output_shape: tuple[int, int, int]
    input_channels: int
    output_channels: int
    forward: int
    input_gradient: int
    filter_gradient: int
    recomputed: bool = False

    @property
    def training(self) -> int:
        """Forward, both gradients and, where recomputed, the second forward."""
        return self.forward * (2 if self.recomputed else 1) + self.input_gradient + self.filter_gradient


def _spatial(row: dict[str, Any], input_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(edge // divisor for edge, divisor in zip(input_shape, row["divisor"]))


def layer_flops(table: list[dict[str, Any]], input_shape: tuple[int, int, int]) -> list[LayerFlops]:
    """The multiply-add layers of ``table`` (``memory.layers.layer_table``) at ``input_shape`` (X, Y, Z),
    each with its FLOPs per sample, in the table's order."""
    for edge, row_divisor in zip(input_shape, max((row["divisor"] for row in table), key=math.prod)):
        if edge % row_divisor:
            raise ValueError(f"input edges {input_shape} must be divisible by {row_divisor} (2**depth)")
    if any(row["kind"] == "RecomputedBlock" for row in table):
        # Batch-norm rows count no FLOPs: the blocks' convolutions alone are what is counted.
        table = layers.expand_recomputed_blocks(table, batch_norm=False)
    rows = {row["name"]: row for row in table}
    # Whether a tensor depends on a trainable weight: only then does backward need its gradient.
    needs_gradient: dict[str, bool] = {}
    counted = []
    for row in table:
        inputs = [rows[name] for name in row["inputs"]]
        needs_gradient[row["name"]] = bool(row["trainable_params"]) or any(
            needs_gradient[item["name"]] for item in inputs
        )
        if row["kind"] not in CONVOLUTIONS:
            continue
        output_shape = _spatial(row, input_shape)
        voxels = math.prod(output_shape)
        channels = row["channels"]
        if row["kind"] == "FoldedUpConv":
            low, skip = inputs
            # [x, ones] at the low resolution, 64 taps each; the skip at full resolution, 27 taps.
            up = math.prod(_spatial(low, input_shape)) * FOLDED_TAPS * (low["channels"] + 1) * channels
            across = voxels * 27 * skip["channels"] * channels
            forward = 2 * (up + across)
            input_gradient = 2 * (up * needs_gradient[low["name"]] + across * needs_gradient[skip["name"]])
            input_channels = low["channels"] + skip["channels"]
        else:
            (source,) = inputs
            input_channels = source["channels"]
            if row["kind"] == "Conv3DTranspose":
                # Each input voxel scatters its whole kernel: input voxels x taps.
                taps_voxels = math.prod(_spatial(source, input_shape)) * math.prod(row["kernel_size"])
            else:
                taps_voxels = voxels * math.prod(row["kernel_size"])
            forward = 2 * taps_voxels * input_channels * channels
            input_gradient = forward if needs_gradient[source["name"]] else 0
        counted.append(
            LayerFlops(
                name=row["name"],
                kind=row["kind"],
                output_shape=output_shape,
                input_channels=input_channels,
                output_channels=channels,
                forward=forward,
                input_gradient=input_gradient,
                filter_gradient=forward,
                recomputed=bool(row.get("recomputed")),
            )
        )
    return counted


def forward_flops(table: list[dict[str, Any]], input_shape: tuple[int, int, int], batch: int = 1) -> int:
    """FLOPs of one forward pass (a predict) of ``batch`` volumes of ``input_shape``."""
    return batch * sum(layer.forward for layer in layer_flops(table, input_shape))


def training_step_flops(table: list[dict[str, Any]], input_shape: tuple[int, int, int], batch: int) -> int:
    """FLOPs of one training step (forward and backward) of ``batch`` crops of ``input_shape``."""
    return batch * sum(layer.training for layer in layer_flops(table, input_shape))


def config_flops(config: Config) -> dict[str, int]:
    """A job's training step and its per-volume forward at its crop (``data.input_shape``, batch)."""
    table = layers.layer_table(config)
    shape = tuple(config.data.input_shape)
    return {
        "training_step": training_step_flops(table, shape, config.training.batch_size),
        "forward_per_volume": forward_flops(table, shape),
    }
