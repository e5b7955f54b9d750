"""Inference planned like training: the peak of ``bigmem-train predict`` on one volume, whole or in tiles.

A forward pass keeps no activations for a backward pass: TensorFlow's executor frees each layer's output
once its last consumer has run, so what is alive at once is a walk over the layer table in execution
order (:func:`forward_live_bytes`): the current layer's inputs and output plus every skip connection
still waiting for its decoder level. The process's peak is that times a measured factor per engine (oneDNN's
blocked-layout copies and workspace travel with the tensors), plus the volumes the predict loop holds in
numpy (the image as read, its padded copy, the probabilities and, for tiles, the blending weights), the
parameters and a runtime baseline (the interpreter, TensorFlow and the loaded model).

The two constants of each engine were fitted on whole ``bigmem-train predict`` processes
(``benchmarks/inference_memory.py``; docs/results/inference.md gives the shapes, the errors and the command
that reproduces them). No TensorFlow at import.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from bigmem_train.config import Config
from bigmem_train.errors import DoesNotFit
from bigmem_train.memory.estimate import DTYPE_BYTES
from bigmem_train.memory.layers import expand_recomputed_blocks
from bigmem_train.sizes import format_bytes

# Per engine: (runtime baseline bytes, forward factor), the upper envelope of whole predict processes
# (benchmarks/inference_memory.py --fit; 8 jobs of 0.17-3.22 GiB, whole volumes and tiles): no job above its
# plan, plans 4.3 % (TensorFlow) and 6.3 % (OpenVINO) above the measured peak on average. TensorFlow's
# baseline holds the interpreter, TensorFlow and the model loaded twice; OpenVINO's process never imports
# TensorFlow (the model is converted in a child process), and its runtime reuses buffers between layers.
ENGINE_CONSTANTS = {
    "tensorflow": (int(0.668 * 2**30), 1.770),
    "openvino": (int(0.156 * 2**30), 0.915),
}
# OpenVINO's one-time conversion of a model: a child process that imports TensorFlow, rebuilds the model and
# exports it, while the predicting process waits at its own baseline. The child's peak, measured on the kit's
# U-Nets with 1.2, 22.6 (the study's) and 90.3 MB of parameters: 0.62, 0.74 and 1.05 GiB (EPYC, 2 cores);
# its envelope: this baseline plus this many bytes per parameter byte (1-4 % above each).
CONVERSION_BASELINE_BYTES = int(0.64 * 2**30)
CONVERSION_BYTES_PER_PARAMETER_BYTE = 5.0
# int8 (NNCF's quantized OpenVINO model, infer/int8.py) is planned as float32: its weights are 1 byte, but
# OpenVINO's CPU plugin keeps float32 activations between some of its int8 layers: each folded
# up-convolution's two halves write float32 at the decoder level's full resolution, the bias half and the
# 1x1 output run float32 (seen in the compiled runtime model's output precisions, OpenVINO 2026.4, on the
# kit's U-Net). bfloat16's plan would not bound those tensors; float32's does. Where the CPU has native
# bfloat16 those float layers run bf16 (infer/int8.float_layers_precision) and the plan is generous: the
# study's volume peaked at 1.16 GiB in int8 with bf16 float layers against 1.78 GiB with f32 ones.
# The quantization's own peak (once per model): NNCF runs the float model on the calibration crops in the
# predicting process after the float conversion's child has exited; planned as that conversion's envelope
# plus the crops, one crop's float32 forward pass and two more copies of the weights (the clone NNCF
# rewrites and the quantized model). On the kit's tiny U-Net NNCF raised a process's resident set by
# 42 MiB (8 crops of 16^3), far inside this plan.
# Overlap of neighbouring tiles, as a fraction of the tile (nnU-Net's default step of half a tile).
TILE_OVERLAP = 0.5


@dataclass
class InferencePlan:
    """How one volume is predicted and the process peak that takes."""

    volume_shape: tuple[int, int, int]
    padded: tuple[int, int, int]  # the volume padded to edges the poolings divide
    mode: str  # "whole" or "tiles"
    window: tuple[int, int, int]  # the network's input: the padded volume, or one tile
    tiles: int
    peak_bytes: int
    limit_bytes: int | None
    breakdown: dict[str, int] = field(default_factory=dict)
    # The walk's live set before the engine's factor: what the constants are fitted against.
    forward_live_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        shape = "x".join(map(str, self.volume_shape))
        window = "x".join(map(str, self.window))
        how = (
            f"whole volume (padded to {window})"
            if self.mode == "whole"
            else f"{self.tiles} tiles of {window}"
        )
        return f"{shape}: {how}, planned peak {format_bytes(self.peak_bytes)}"


def _elements(row: dict[str, Any], shape: tuple[int, int, int]) -> int:
    return math.prod(edge // divisor for edge, divisor in zip(shape, row["divisor"])) * row["channels"]


def forward_live_bytes(
    table: list[dict[str, Any]], window: tuple[int, int, int], batch_norm: bool = True
) -> int:
    """The most bytes of layer outputs alive at once in one forward pass over ``window`` (batch 1)."""
    rows = expand_recomputed_blocks(table, batch_norm)
    consumers: dict[str, int] = {}
    for row in rows:
        for name in row["inputs"]:
            consumers[name] = consumers.get(name, 0) + 1
    live: dict[str, int] = {}
    peak = 0
    for row in rows:
        live[row["name"]] = _elements(row, window) * DTYPE_BYTES.get(row["dtype"], 4)
        peak = max(peak, sum(live.values()))
        for name in row["inputs"]:
            consumers[name] -= 1
            if consumers[name] == 0:
                live.pop(name, None)
    return peak


def parameter_bytes(table: list[dict[str, Any]]) -> int:
    return 4 * sum(row["trainable_params"] + row["non_trainable_params"] for row in table)


def padded_shape(shape: tuple[int, int, int], depth: int) -> tuple[int, int, int]:
    """Each edge rounded up to a multiple of 2**depth (the U-Net's poolings must divide it)."""
    step = 2**depth
    return tuple(-(-edge // step) * step for edge in shape)


def tile_starts(length: int, tile: int, overlap: float = TILE_OVERLAP) -> list[int]:
    """Starts of tiles of ``tile`` covering ``length``, neighbours overlapping by about ``overlap``,
    the first at 0 and the last ending at ``length`` (nnU-Net's sliding-window steps)."""
    if tile >= length:
        return [0]
    count = math.ceil((length - tile) / (tile * (1 - overlap))) + 1
    step = (length - tile) / (count - 1)
    return sorted({round(index * step) for index in range(count)})


def plan_volume(
    config: Config,
    table: list[dict[str, Any]],
    volume_shape: tuple[int, int, int],
    image_channels: int,
    limit_bytes: int | None,
    window: tuple[int, int, int] | None = None,
    tta: bool = False,
    engine: str = "tensorflow",
) -> InferencePlan:
    """Plan one volume: whole when its padded volume fits ``limit_bytes`` (None: always), else the
    largest tile that fits (the longest edge halved first); :class:`DoesNotFit` when not even the
    smallest tile (2**(depth+1) a side) does. ``window`` forces a tile shape (``--tile``); ``tta``
    adds the sum of the mirrored predictions."""
    depth = config.model.depth
    padded = padded_shape(volume_shape, depth)
    candidates: list[tuple[int, int, int]]
    if window is not None:
        candidates = [tuple(min(edge, full) for edge, full in zip(padded_shape(window, depth), padded))]
    else:
        candidates = [padded, *_tile_candidates(padded, depth)]
    last = None
    for candidate in candidates:
        plan = _plan_window(config, table, volume_shape, image_channels, candidate, limit_bytes, tta, engine)
        last = plan
        if limit_bytes is None or plan.peak_bytes <= limit_bytes:
            return plan
    assert last is not None
    raise DoesNotFit(
        f"predicting a {'x'.join(map(str, volume_shape))} volume needs {format_bytes(last.peak_bytes)} even "
        f"in tiles of {'x'.join(map(str, last.window))}, more than the {format_bytes(limit_bytes)} usable"
    )


def _tile_candidates(padded: tuple[int, int, int], depth: int) -> list[tuple[int, int, int]]:
    """Tiles from large to small: the longest edge halved first, down to 2**depth * 2 per edge."""
    step, smallest = 2**depth, 2 ** (depth + 1)
    tiles, tile = [], list(padded)
    while True:
        axis = max(range(3), key=lambda index: tile[index])
        if tile[axis] <= smallest:
            break
        tile[axis] = max(smallest, -(-(tile[axis] // 2) // step) * step)
        tiles.append(tuple(tile))
    return tiles


def _plan_window(
    config: Config,
    table: list[dict[str, Any]],
    volume_shape: tuple[int, int, int],
    image_channels: int,
    window: tuple[int, int, int],
    limit_bytes: int | None,
    tta: bool = False,
    engine: str = "tensorflow",
) -> InferencePlan:
    baseline, factor = ENGINE_CONSTANTS[engine]
    padded = padded_shape(volume_shape, config.model.depth)
    whole = tuple(window) == tuple(padded)
    voxels, padded_voxels = math.prod(volume_shape), math.prod(padded)
    classes = config.model.output_classes
    channels = config.num_channels
    tiles = 1
    if not whole:
        tiles = math.prod(len(tile_starts(full, edge)) for full, edge in zip(padded, window))
    live = forward_live_bytes(table, window, config.model.batch_norm)
    breakdown = {
        # The image as read (float32, every channel up to the last wanted) and the normalized selection.
        "image": voxels * 4 * (image_channels + channels),
        # The padded input and the probabilities at the padded shape, then cropped and thresholded.
        "volumes": padded_voxels * 4 * (channels + classes) + voxels * (4 * classes + 1),
        # What the engine copies in and out: the network's input and output tensors beside the numpy arrays.
        "engine_copies": math.prod(window) * 4 * (channels + classes),
        # Tiles: the blending weights over the volume and the probability sum beside the output.
        "blending": 0 if whole else padded_voxels * 4 * (1 + classes),
        # Test-time mirroring: the sum of the mirrored predictions beside the one being made.
        "mirroring": padded_voxels * 4 * classes if tta else 0,
        "parameters": parameter_bytes(table),
        "forward_pass": int(factor * live),
        "runtime_baseline": baseline,
    }
    return InferencePlan(
        volume_shape=tuple(volume_shape),
        padded=tuple(padded),
        mode="whole" if whole else "tiles",
        window=tuple(window),
        tiles=tiles,
        peak_bytes=sum(breakdown.values()),
        limit_bytes=limit_bytes,
        breakdown=breakdown,
        forward_live_bytes=live,
    )


def conversion_peak_bytes(table: list[dict[str, Any]]) -> int:
    """What the host holds while OpenVINO converts the model: the converting child's envelope beside the
    predicting process's baseline."""
    child = CONVERSION_BASELINE_BYTES + int(CONVERSION_BYTES_PER_PARAMETER_BYTE * parameter_bytes(table))
    return child + ENGINE_CONSTANTS["openvino"][0]


def quantization_peak_bytes(config: Config, table: list[dict[str, Any]], crops: int = 32) -> int:
    """What the host holds while NNCF quantizes the model to int8 on ``crops`` calibration crops of the
    training input shape (infer/int8.py's CALIBRATION_CROPS): the conversion's envelope, the crops, one
    crop's float32 forward pass in OpenVINO and two more copies of the weights."""
    _, factor = ENGINE_CONSTANTS["openvino"]
    crop = tuple(config.data.input_shape)
    crop_bytes = math.prod(crop) * config.num_channels * 4
    forward = int(factor * forward_live_bytes(table, crop, config.model.batch_norm))
    return conversion_peak_bytes(table) + crops * crop_bytes + forward + 2 * parameter_bytes(table)
