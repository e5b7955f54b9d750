"""The memory model: a job's peak resident memory, component by component, from its layer table.

Peak = weights + gradients + optimizer slots + activations kept for backward + largest transient
workspace + input pipeline buffers + runtime baseline. What each op keeps for backward follows
TensorFlow's gradient definitions (``kept_tensors``); ``backward_live_bytes`` walks the backward pass to
find the most activations and activation gradients alive at once. The machine constants come from
:mod:`bigmem_train.memory.constants`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from bigmem_train.config import Config
from bigmem_train.memory import constants, layers
from bigmem_train.memory.constants import Calibration
from bigmem_train.memory.layers import expand_recomputed_blocks
from bigmem_train.model.conv_geometry import ConvGeometry, chunk_copy_bytes, filter_gradient_runs_gemm

BREAKDOWN_KEYS = (
    "weights",
    "gradients",
    "optimizer_slots",
    "parameter_copies",
    "convolution_kernels",
    "activations",
    "workspace",
    "input_pipeline",
    "runtime_baseline",
    "envelope",
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

# Full-size float32 tensors of one output channel the study's loss (0.7 * -log Dice + 0.3 * cross-entropy,
# model.make_loss) keeps. One class (sigmoid, binary cross-entropy): the cast label, clip(y_pred), 1 - clip,
# log(clip), log(1 - clip), 1 - label, label * y_pred: 7. Several classes (softmax) take the other branch:
# the one-hot label, clip(y_pred) and log(clip) of every class, and Dice's foreground slices of label and
# prediction (every class but the background): 5 x classes - 2. The loss alone (benchmarks/planner_loss_probe.py,
# its forward + backward over the same with a loss that keeps nothing; 160x160x128 and 240x240x144, batch 1,
# three probe runs) peaks at 6.5 of these at 1 class, 5.5-8.0 / 5.8-7.8 / 12.0-16.0 / 33.0-39.0 at 2 / 3 / 4 / 8
# classes (formula 8 / 13 / 18 / 38): at or under what the code keeps, by what the allocator reuses from one
# freed tensor to the next, 5 a class in every run. Counting 7 per channel at every class count (until
# December 2026: 28 at 4 classes) over-planned the 4-class jobs by 10 of them (0.35 GB at the 240x240x144 tile).
LOSS_KEPT_TENSORS = 7


def loss_kept_tensors(classes: int) -> int:
    """Full-size float32 tensors of one output channel the loss keeps for backward, at ``classes`` outputs."""
    return LOSS_KEPT_TENSORS if classes == 1 else 5 * classes - 2


# Float32 tensors of its input's size that Keras 3's unfused batch normalization holds in its backward on
# top of the gradients of its output and input: its input gradient has three terms (through the scaled
# input, the mean and the mean of squares of the batch moments), each a full-size tensor, summed by one
# AddN. Measured (benchmarks/planner_layer_probe.py --layers bn,conv,relu, 128^3 x 16 channels, ops
# inline): one layer's forward + backward rises by 4 tensors of its input's size at batch 1 and 4-5 at
# batch 2, where the output gradient + input gradient (+ the output, freed after the loss) are 2-3.
# The kit's layer (norm.py, TensorFlow's fused kernel) holds none: its forward + backward rises by 2 tensors
# at batch 1 and 2 (256 and 512 MiB at 128^3 x 16, BIGMEM_BATCH_NORM=keras: 512 and 1024), the two gradients.
# Keras' layer is still what multi-worker jobs run (batch statistics synchronized across workers).
BATCH_NORM_BACKWARD_TRANSIENTS = 2
FUSED_BATCH_NORM_BACKWARD_TRANSIENTS = 0

# Under a mixed policy Keras 3 runs batch normalization in float32 (its input cast up, its output cast
# down), so its backward casts the output gradient up to float32 and computes the input gradient in float32
# before casting it down: both gradients exist in float32 (4 B) where the walk counts them in the compute
# dtype (2 B), one more float32 tensor of the input's size. Measured (benchmarks/planner_layer_probe.py
# --layers bn --precision mixed_bfloat16, 160x160x128 x 16 channels, 200 MiB per float32 sample): one
# layer's forward + backward rose by 1000 MiB in bf16 against 800 MiB in float32 at batch 1.
# The fused layer computes in float32 likewise; its forward + backward rose by 576 and 896 MiB at batch 1 and
# 2 (128^3 x 16, 128 MiB per float32 sample), 2 float32 tensors above its float32 run on average.
MIXED_BATCH_NORM_GRADIENT_COPIES = 1
MIXED_FUSED_BATCH_NORM_GRADIENT_COPIES = 2

# Adam keeps two float32 slots (first and second moment) per trainable weight.
ADAM_SLOTS = 2

# A reader (data.prepare_case) holds the crop as read, the float32 image and label, and a flipped copy.
READER_COPIES = 3
# Readers assumed for data.parallel_reads "auto" (tf.data AUTOTUNE).
PARALLEL_READS_AUTO = 4


def _elements(row: dict[str, Any], batch: int, shape: tuple[int, int, int]) -> int:
    return (
        batch * math.prod(edge // divisor for edge, divisor in zip(shape, row["divisor"])) * row["channels"]
    )


def _block_of(name: str) -> str:
    """``down0_conv1`` -> ``down0``: the unit gradient recomputation treats as one (up blocks include
    their upsampling and concatenation, as model.RecomputedBlock does)."""
    return name.split("_", 1)[0]


CONVOLUTION_KINDS = {"Conv3D", "Conv3DTranspose", "Conv2D", "Dense"}
# upconv.FoldedUpConv: a transposed convolution and a convolution in one layer (model.fold_upsampling).
FOLDED_KIND = "FoldedUpConv"


@dataclass
class KeptTensors:
    """What the forward pass keeps for backward: tensor key -> bytes, which layers' backward read each
    tensor, and the block (``_block_of``) that produced it."""

    sizes: dict[str, int] = field(default_factory=dict)
    readers: dict[str, set[str]] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)


def kept_tensors(table: list[dict[str, Any]], batch: int, shape: tuple[int, int, int]) -> KeptTensors:
    """Tensors the backward pass needs, by identity, and who reads them.

    Rules (TensorFlow gradient definitions, Keras 3 layers):
    - Conv3D / Conv3DTranspose keep their input (filter gradient), in the layer's compute dtype (a cast
      copy when the producer's dtype differs, e.g. the float32 input under mixed_bfloat16); a fused
      sigmoid/softmax keeps the layer's output.
    - BatchNormalization (the kit's fused layer and Keras 3's unfused one alike) keeps its input in float32
      (a float32 copy under mixed_bfloat16); the output is transient.
    - ReLU, sigmoid, softmax keep their output; MaxPool3D keeps its input and output; Concatenate and
      UpSampling keep nothing.
    - FoldedUpConv (upconv.py) keeps both inputs (its skip convolution's and its transposed convolution's
      filter gradients) and the low-resolution input with its channel of ones appended.
    """
    rows = {row["name"]: row for row in table}
    kept = KeptTensors()

    def keep(key: str, producer: dict[str, Any], dtype: str, reader: str) -> None:
        kept.sizes[key] = _elements(producer, batch, shape) * DTYPE_BYTES.get(dtype, 4)
        kept.owner[key] = _block_of(producer["name"])
        kept.readers.setdefault(key, set()).add(reader)

    def keep_input(row: dict[str, Any], dtype: str) -> None:
        for name in row["inputs"]:
            producer = rows[name]
            key = name if producer["dtype"] == dtype else f"{name}:{dtype}"
            keep(key, producer, dtype, row["name"])

    for row in table:
        kind = row["kind"]
        if kind == "InputLayer":
            keep(row["name"], row, row["dtype"], row["name"])  # the batch the step runs on
        elif kind in CONVOLUTION_KINDS:
            keep_input(row, row["kernel_dtype"])
            if row["activation"] not in (None, "linear"):
                keep(row["name"], row, row["dtype"], row["name"])
        elif kind == FOLDED_KIND:
            keep_input(row, row["kernel_dtype"])
            low = rows[row["inputs"][0]]
            ones = f"{row['name']}:with_ones"
            kept.sizes[ones] = (
                _elements(low, batch, shape) * (low["channels"] + 1) // low["channels"]
            ) * DTYPE_BYTES.get(row["kernel_dtype"], 4)
            kept.owner[ones] = _block_of(row["name"])
            kept.readers[ones] = {row["name"]}
        elif kind == "BatchNormalization":
            keep_input(row, "float32")
        elif kind in {"Activation", "ReLU", "Softmax"}:
            if row["activation"] not in (None, "linear") or kind != "Activation":
                keep(row["name"], row, row["dtype"], row["name"])
        elif kind in {"MaxPooling3D", "AveragePooling3D"}:
            keep_input(row, row["dtype"])
            keep(row["name"], row, row["dtype"], row["name"])
        elif kind in {"Concatenate", "UpSampling3D", "Add", "Cropping3D", "ZeroPadding3D"}:
            pass
        else:  # Unknown layer: assume it keeps input and output.
            keep_input(row, row["dtype"])
            keep(row["name"], row, row["dtype"], row["name"])
    return kept


def _recomputed_internals(table: list[dict[str, Any]], kept: KeptTensors) -> dict[str, dict[str, int]]:
    """Under gradient recomputation: the kept tensors that never leave their block, by block, removed
    from ``kept`` (only tensors that cross a block boundary are kept; a block's internals are rebuilt
    one block at a time during backward)."""
    consumers: dict[str, set[str]] = {}
    for row in table:
        for name in row["inputs"]:
            consumers.setdefault(name, set()).add(_block_of(row["name"]))
    internals: dict[str, dict[str, int]] = {}
    for key in list(kept.sizes):
        name = key.split(":")[0]
        block = kept.owner[key]
        if block in {"volume", "segmentation"} or consumers.get(name, set()) - {block}:
            continue
        internals.setdefault(block, {})[key] = kept.sizes.pop(key)
    return internals


def backward_live_bytes(
    table: list[dict[str, Any]],
    batch: int,
    shape: tuple[int, int, int],
    recompute: bool,
    fused_batch_norm: bool = True,
) -> tuple[int, int]:
    """(bytes kept for backward incl. the loss's, largest bytes of activations and activation gradients
    alive at once during backward), by walking the backward pass layer by layer.

    Walking the layers in reverse: a layer's backward reads the gradient of its output and writes one
    for each input (a tensor read by several layers sums its gradients, one extra buffer while adding);
    the gradient of a layer's output is freed after its backward, a kept tensor after the last backward
    that reads it. Under recomputation a block's internals are rebuilt while its layers run backward.
    ``fused_batch_norm``: the kit's batch normalization (norm.py) rather than Keras' unfused layer.
    """
    rows = {row["name"]: row for row in table}
    kept = kept_tensors(table, batch, shape)
    output = table[-1]
    channels = output["channels"]
    kept.sizes["loss"] = loss_kept_tensors(channels) * _elements(output, batch, shape) // channels * 4
    kept.readers["loss"] = {output["name"]}
    kept.owner["loss"] = _block_of(output["name"])
    internals = _recomputed_internals(table, kept) if recompute else {}
    kept_total = sum(kept.sizes.values())
    rebuilds = _rebuilt_tensors(rows, kept, internals) if recompute else {}

    def gradient_bytes(row: dict[str, Any]) -> int:
        return _elements(row, batch, shape) * DTYPE_BYTES.get(row["dtype"], 4)

    pending = {key: set(readers) for key, readers in kept.readers.items() if key in kept.sizes}
    alive = dict(kept.sizes)
    gradients = {output["name"]: gradient_bytes(output)}
    peak = kept_total + gradients[output["name"]]
    for row in reversed(table):
        if row["kind"] == "InputLayer":
            continue
        # A recomputed block's backward starts by running its forward again: what that forward keeps
        # is alive from here until its own last reader.
        for key, (size, readers) in rebuilds.pop(row.get("block", ""), {}).items():
            alive[key], pending[key] = size, set(readers)
        adding = 0
        for name in row["inputs"]:
            producer = rows[name]
            if producer["kind"] == "InputLayer":
                continue  # no gradient for the data
            if name in gradients:
                adding += gradient_bytes(producer)
            else:
                gradients[name] = gradient_bytes(producer)
        adding += _chunk_copies(row, rows, batch, shape)
        if row["kind"] == "BatchNormalization":
            mixed = row["dtype"] != "float32"
            if fused_batch_norm:
                copies = FUSED_BATCH_NORM_BACKWARD_TRANSIENTS + mixed * MIXED_FUSED_BATCH_NORM_GRADIENT_COPIES
            else:
                copies = BATCH_NORM_BACKWARD_TRANSIENTS + mixed * MIXED_BATCH_NORM_GRADIENT_COPIES
            adding += copies * _elements(rows[row["inputs"][0]], batch, shape) * 4
        peak = max(peak, sum(alive.values()) + sum(gradients.values()) + adding)
        gradients.pop(row["name"], None)
        for key in list(pending):
            pending[key].discard(row["name"])
            if not pending[key]:
                del pending[key], alive[key]
    return kept_total, peak


def _rebuilt_tensors(
    rows: dict[str, dict[str, Any]], kept: KeptTensors, internals: dict[str, dict[str, int]]
) -> dict[str, dict[str, tuple[int, set[str]]]]:
    """Per recomputed block, what ``tf.recompute_grad`` holds while the block runs backward: key ->
    (bytes, the block's layers whose backward reads it).

    The block's forward runs again on copies of its inputs (in graph mode each input becomes
    ``input + 0``, computed from the output gradient so the rebuild waits for it: a new tensor of the
    input's size), and its gradient tape keeps what the same layers keep in a plain run: the block's
    internals again, and new copies of the tensors that cross its boundary (the copied inputs where a
    layer of the block keeps them, the block's output recomputed). The originals stay kept for the
    layers outside the block that read them. Each is freed after the last of the block's layers that
    reads it, as in a plain run.
    """

    def block_of(name: str) -> str | None:
        row = rows.get(name, {})
        return row.get("block") if row.get("recomputed") else None

    rebuilds: dict[str, dict[str, tuple[int, set[str]]]] = {}
    for block, tensors in internals.items():
        for key, size in tensors.items():
            rebuilds.setdefault(block, {})[key] = (size, set(kept.readers[key]))
    for key, size in kept.sizes.items():
        by_block: dict[str, set[str]] = {}
        for reader in kept.readers.get(key, ()):
            block = block_of(reader)
            if block:
                by_block.setdefault(block, set()).add(reader)
        for block, readers in by_block.items():
            rebuilds.setdefault(block, {})[f"{key}@{block}"] = (size, readers)
    return rebuilds


def _chunk_copies(row: dict[str, Any], rows: dict[str, dict[str, Any]], batch: int, shape) -> int:
    """The input and output-gradient slabs a Conv3D whose filter gradient the model computes in depth
    chunks (``conv.ChunkedConv3D``, chosen by the same ``conv_geometry.plan_depth_chunk`` when the model is
    built) copies while its backward runs; 0 for every other layer."""
    kernel = row.get("kernel_size") or []
    if row["kind"] != "Conv3D" or math.prod(kernel or [1]) <= 1 or not row["inputs"]:
        return 0
    if not onednn_uses_gemm_backward_weights():
        return 0  # the model chunks only where oneDNN's filter gradient is its gemm kernel
    producer = rows[row["inputs"][0]]
    geometry = ConvGeometry(
        tuple(edge // divisor for edge, divisor in zip(shape, producer["divisor"])),
        producer["channels"],
        row["channels"],
        tuple(kernel),
        "same",
        DTYPE_BYTES.get(row["kernel_dtype"], 4),
    )
    return chunk_copy_bytes(geometry, batch)


def _input_pipeline_bytes(config: Config, batch: int, shape: tuple[int, int, int]) -> int:
    """Batches in flight (the one in the step, the one being assembled, the prefetched ones) and the
    samples the parallel readers are preparing (the crop as read, the float32 image and label)."""
    sample_bytes = math.prod(shape) * (config.num_channels + 1) * 4
    batches = config.data.prefetch_batches + 2
    readers = (
        PARALLEL_READS_AUTO if config.data.parallel_reads == "auto" else max(1, config.data.parallel_reads)
    )
    return batches * batch * sample_bytes + readers * READER_COPIES * sample_bytes


def workspace_reference_bytes(table: list[dict[str, Any]], batch: int, shape: tuple[int, int, int]) -> int:
    """The largest convolution's patch matrix for one sample: kernel volume x input channels x output voxels.

    TensorFlow's CPU Conv3D backward kernels (Conv3DCustomBackpropInputOp / FilterOp) allocate a column
    buffer of [images per shard, output voxels, kernel volume x input channels] and walk the batch one
    shard at a time; a shard is one image whenever one image's matrices exceed the L3 cache (every job
    worth planning). So the transient peak grows with the sample, not with the batch. A transposed
    convolution's forward pass is such a backward-input kernel over its own input voxels.
    """
    rows = {row["name"]: row for row in table}
    largest = 0
    for row in table:
        kernel = math.prod(row.get("kernel_size") or [3, 3, 3]) if row["kind"].startswith("Conv") else 0
        if not kernel or not row["inputs"]:
            continue
        producer = rows[row["inputs"][0]]
        itemsize = DTYPE_BYTES.get(row["kernel_dtype"], 4)
        if row["kind"] == "Conv3DTranspose":
            patches = kernel * row["channels"] * _elements(producer, 1, shape) // producer["channels"]
        else:
            patches = kernel * producer["channels"] * _elements(row, 1, shape) // row["channels"]
        largest = max(largest, patches * itemsize)
    return largest


# CPU flags of oneDNN's avx512_core ISA. With them, oneDNN's f32 Conv3D backward-weights runs its direct
# kernel (jit:avx512_core; ONEDNN_VERBOSE shows it), whose scratchpad is a few MiB at any size (measured:
# 5-6 MiB for convolutions whose gemm scratchpad would be 33-329 MiB, benchmarks/planner_conv_scratchpad.py
# on a Xeon with AVX-512 and AMX). Without them (AVX2 only) it runs the gemm kernel below.


def onednn_uses_gemm_backward_weights(cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether oneDNN's Conv3D filter gradient runs its gemm kernel, with the im2col scratchpad
    (``onednn_scratchpad_bytes``) and the limit the model chunks under, on this CPU (or one with
    ``cpu_flags``): on CPUs without AVX-512 or with oneDNN capped below it. The one answer the model
    (``conv.conv3d_for``) and the planner share: ``conv_geometry.filter_gradient_runs_gemm``."""
    return filter_gradient_runs_gemm(cpu_flags)


# oneDNN's gemm-based backward-weights convolution (x64:gemm:jit, chosen for every 3x3x3 Conv3D with
# channels-last data on AVX2 CPUs) books its scratchpad per thread: a transposed copy of one input sample and the
# im2col matrix of one output depth slice (gemm_convolution_utils.cpp, init_conf, nspc bwd_w). It runs
# on one thread unless the slice is small (output rows per thread < 256) and the batch has more than
# one sample, and only then if the threads' copies stay under oneDNN's scratchpad limit (1 GiB).
ONEDNN_OUTER_THREADING_ROWS = 256
ONEDNN_SCRATCHPAD_LIMIT = 1 << 30


def onednn_scratchpad_bytes(
    table: list[dict[str, Any]], batch: int, shape: tuple[int, int, int], threads: int = 1
) -> int:
    """The largest scratchpad oneDNN's Conv3D backward-weights kernel books for this model: one input
    sample of the convolution (transposed) + its im2col matrix for one output depth slice (kernel volume
    x input channels x output H x W), in the kernel's dtype; times the threads when oneDNN threads the
    kernel over the batch.

    oneDNN keeps a primitive's scratchpad in a per-thread global buffer that grows to the largest one it
    has seen and lives as long as the cached primitives: it is held through the rest of the run (measured
    on single ops, ``benchmarks/planner_conv_scratchpad.py``: 160x152x104, 16 -> 8 channels, batch 1
    rises by 191 MiB, the formula gives 180 MiB + the kernel's own ~11 MiB). Convolutions with a 1x1x1
    kernel and transposed convolutions use other kernels (a few MiB).
    """
    rows = {row["name"]: row for row in table}
    largest = 0
    for row in table:
        kernel = math.prod(row.get("kernel_size") or [1])
        if row["kind"] != "Conv3D" or kernel <= 1 or not row["inputs"]:
            continue
        producer = rows[row["inputs"][0]]
        itemsize = DTYPE_BYTES.get(row["kernel_dtype"], 4)
        sample_input = _elements(producer, 1, shape)
        depth = shape[0] // row["divisor"][0]
        slice_outputs = _elements(row, 1, shape) // row["channels"] // depth
        per_thread = (sample_input + kernel * producer["channels"] * slice_outputs) * itemsize
        copies = 1
        if (
            batch > 1
            and threads > 1
            and slice_outputs // threads < ONEDNN_OUTER_THREADING_ROWS
            and threads * per_thread < ONEDNN_SCRATCHPAD_LIMIT
        ):
            copies = threads
        largest = max(largest, copies * per_thread)
    return largest


def backward_concurrency(config: Config) -> int:
    """Column buffers alive at once: 1 with one inter-op thread (train.choose_threads' default); with more,
    a convolution's input-gradient and filter-gradient kernels run side by side, each with its own."""
    if config.runs_ops_inline:
        return 1
    return min(2, config.runtime.inter_op_threads or 1)


def convolution_layers(table: list[dict[str, Any]]) -> int:
    """How many convolutions the (expanded) model runs: each has its own cached kernels (a FoldedUpConv runs
    two: its transposed convolution and its skip convolution)."""
    return sum(1 for row in table if row["kind"] in CONVOLUTION_KINDS) + 2 * sum(
        1 for row in table if row["kind"] == FOLDED_KIND
    )


def breakdown_for(
    config: Config,
    table: list[dict[str, Any]],
    calibration: Calibration,
    batch: int,
    shape: tuple[int, int, int],
) -> dict[str, int]:
    """The peak-memory breakdown of ``config``'s model at ``batch`` and ``shape`` (bytes per component)."""
    table = expand_recomputed_blocks(table, config.model.batch_norm)
    trainable = sum(row["trainable_params"] for row in table)
    non_trainable = sum(row["non_trainable_params"] for row in table)
    mixed = config.runtime.precision != "float32"
    # Variables are float32 even under mixed precision; then their bfloat16 casts live through the step.
    weights = (trainable + non_trainable) * 4 + (trainable * 2 if mixed else 0)
    gradients = trainable * 4 + (trainable * 2 if mixed else 0)
    optimizer_slots = trainable * 4 * ADAM_SLOTS
    kept, live = backward_live_bytes(
        table, batch, shape, config.model.recompute, fused_batch_norm=not config.synchronized_batch_norm
    )
    factor = calibration.activation_factor
    if config.model.recompute and calibration.recompute_factor is not None:
        factor = calibration.recompute_factor
    if mixed and calibration.mixed_precision_factor is not None:
        factor *= calibration.mixed_precision_factor
    activations = int(factor * kept)
    # The transient part of the peak: activation gradients (and a rebuilt block) alive with the kept
    # tensors at the backward peak; with TensorFlow's own Conv3D kernels their per-sample column buffer,
    # under oneDNN the largest backward-weights scratchpad, held from its first use on (docs/design/planner.md).
    column_buffers = scratchpad = 0
    if config.runtime.onednn:
        if onednn_uses_gemm_backward_weights():
            scratchpad = onednn_scratchpad_bytes(
                table, batch, shape, config.runtime.intra_op_threads or os.cpu_count() or 1
            )
    else:
        column_buffers = workspace_reference_bytes(table, batch, shape) * backward_concurrency(config)
    workspace = (
        int(factor * live) - activations + int(calibration.workspace_factor * column_buffers) + scratchpad
    )
    parts = {
        "weights": weights,
        "gradients": gradients,
        "optimizer_slots": optimizer_slots,
        "parameter_copies": int(calibration.parameter_copies * trainable * 4),
        "convolution_kernels": calibration.per_convolution_bytes * convolution_layers(table),
        "activations": activations,
        "workspace": workspace,
        "input_pipeline": _input_pipeline_bytes(config, batch, shape),
        "runtime_baseline": calibration.runtime_baseline_bytes,
    }
    # The plan is the upper envelope of the job's runs, not their middle (constants.PLAN_COVERAGE).
    parts["envelope"] = int(calibration.margin_for(config) * sum(parts.values()))
    return parts


def estimate(config: Config, calibration: Calibration | None = None) -> dict[str, int]:
    """Predicted peak-memory breakdown (bytes) of ``config`` as it stands: keys in ``BREAKDOWN_KEYS``."""
    calibration = calibration or constants.load_calibration()
    return breakdown_for(
        config,
        layers.layer_table(config),
        calibration,
        config.training.batch_size,
        tuple(config.data.input_shape),
    )
