"""Memory planner: predict a training job's peak resident memory, size a job to a target, place it on NUMA nodes.

The model of memory is derived from the Keras model itself. ``layer_table`` builds the configured U-Net
(``model.build_unet``) once and records, layer by layer, its kind, inputs, output channels, spatial
down-sampling and dtype; that table does not depend on the batch or the input shape (edges are divisible
by ``2**depth``), so sizing a job is arithmetic. The table is built in a child process (importing
TensorFlow takes seconds and must not happen before the pipeline re-executes under numactl) and cached.

Peak = weights + gradients + optimizer slots + activations kept for backward + largest transient
workspace + input pipeline buffers + runtime baseline. What each op keeps for backward follows
TensorFlow's gradient definitions (see ``kept_tensors``); ``backward_live_bytes`` walks the backward
pass to find the most activations and activation gradients alive at once. The machine constants (runtime
baseline, activation factor; workspace factor with oneDNN off) are measured by ``bigmem-train plan --calibrate``
(:mod:`bigmem_train.calibration`) under the runtime the job runs with.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .config import MAX_BATCH_SIZE, Config
from .errors import BadInput
from .host import HostFacts
from .sizes import GIB, format_bytes, gib, parse_size

BREAKDOWN_KEYS = (
    "weights",
    "gradients",
    "optimizer_slots",
    "activations",
    "workspace",
    "input_pipeline",
    "runtime_baseline",
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

# Full-size float32 tensors the study's loss (0.7 * -log Dice + 0.3 * BCE) keeps per output channel:
# the cast label, clip(y_pred), 1 - clip, log(clip), log(1 - clip), 1 - label, label * y_pred.
LOSS_KEPT_TENSORS = 7

# Adam keeps two float32 slots (first and second moment) per trainable weight.
ADAM_SLOTS = 2

# A reader (data.prepare_case) holds the crop as read, the float32 image and label, and a flipped copy.
READER_COPIES = 3
# Readers assumed for data.parallel_reads "auto" (tf.data AUTOTUNE).
PARALLEL_READS_AUTO = 4


# --------------------------------------------------------------------------------------------------
# Layer table: what the Keras model is made of, independent of batch and shape.

# Bumped when the table gains a field, so cached tables are rebuilt.
TABLE_VERSION = 3


def _model_source_digest() -> str:
    source = (Path(__file__).parent / "model.py").read_bytes()
    return hashlib.sha256(source).hexdigest()[:16]


def _table_key(config: Config) -> dict[str, Any]:
    return {
        "model": config.model.model_dump(mode="json"),
        "channels": config.num_channels,
        "precision": config.runtime.precision,
        "model_py": _model_source_digest(),
        "table_version": TABLE_VERSION,
    }


def cache_dir() -> Path:
    """Where layer tables and the user's calibration live: $BIGMEM_CACHE_DIR or ~/.cache/bigmem-train."""
    if os.environ.get("BIGMEM_CACHE_DIR"):
        return Path(os.environ["BIGMEM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bigmem-train"


def layer_table_from_keras(config: Config) -> list[dict[str, Any]]:
    """Build the configured U-Net with Keras in this process and describe each layer (imports TensorFlow)."""
    import keras

    from .model import build_unet

    edge = 2 ** config.model.depth * 2
    build_shape = (edge, edge, edge)
    previous_policy = keras.mixed_precision.global_policy()
    try:
        keras.mixed_precision.set_global_policy(config.runtime.precision)
        model = build_unet(config.model, build_shape, config.num_channels)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
    table = []
    for layer in model.layers:
        output = layer.output
        inputs: list[str] = []
        if layer._inbound_nodes and type(layer).__name__ != "InputLayer":
            for tensor in layer._inbound_nodes[0].input_tensors:
                inputs.append(tensor._keras_history.operation.name)
        spatial = output.shape[1:4]
        activation = getattr(layer, "activation", None)
        table.append(
            {
                "name": layer.name,
                "kind": type(layer).__name__,
                "inputs": inputs,
                "divisor": [build // int(size) for build, size in zip(build_shape, spatial)],
                "channels": int(output.shape[-1]),
                "dtype": str(output.dtype),
                "activation": getattr(activation, "__name__", None) if activation is not None else None,
                "trainable_params": int(sum(math.prod(w.shape) for w in layer.trainable_weights)),
                "non_trainable_params": int(sum(math.prod(w.shape) for w in layer.non_trainable_weights)),
                "kernel_dtype": str(getattr(layer, "compute_dtype", "float32")),
                "kernel_size": list(getattr(layer, "kernel_size", ()) or ()),
                "upsampling": getattr(layer, "upsampling", None),
            }
        )
    return table


def layer_table(config: Config) -> list[dict[str, Any]]:
    """The layer table of ``config``'s model: from the cache, from Keras if it is loaded, else a child process."""
    key = _table_key(config)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    cache_file = cache_dir() / "layers" / f"{digest}.json"
    try:
        return json.loads(cache_file.read_text())["table"]
    except (OSError, ValueError, KeyError):
        pass
    if "keras" in sys.modules:
        table = layer_table_from_keras(config)
    else:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(
            [sys.executable, "-m", "bigmem_train.planner", "--layer-table"],
            input=config.model_dump_json(),
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if result.returncode != 0:
            raise BadInput(f"cannot build the model to plan it: {result.stderr.strip().splitlines()[-1:]}")
        table = json.loads(result.stdout.strip().splitlines()[-1])
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({"key": key, "table": table}))
    except OSError:
        pass  # A read-only home only costs the child process next time.
    return table


# --------------------------------------------------------------------------------------------------
# The memory model.


@dataclass
class Calibration:
    """The machine constants of the model, measured by ``bigmem-train plan --calibrate``.

    Each is fitted for one runtime (oneDNN on or off, allocator, TensorFlow version; recorded in
    ``measured``): the kernels decide what a convolution allocates.
    """

    # Resident memory of the training process that does not scale with the job: Python, TensorFlow,
    # oneDNN and its thread pools, the traced graph.
    runtime_baseline_bytes: int = 870 * 1024**2
    # Resident bytes per byte of tensors alive at the backward peak (activations kept for backward and
    # the activation gradients alive with them, ``backward_live_bytes``): 1 would be a perfect allocator
    # and no op temporaries.
    activation_factor: float = 1.0
    # Column buffers of TensorFlow's own (Eigen) Conv3D backward kernels (runtime.onednn false), as a
    # multiple of the largest convolution's patch matrix for one sample (``workspace_reference_bytes``):
    # about 1, those kernels build that matrix a sample or two at a time. oneDNN's build none: a
    # calibration under oneDNN cannot measure it and keeps this built-in value, used only by jobs with
    # oneDNN off.
    workspace_factor: float = 1.0
    source: str = "built-in defaults (not calibrated)"
    measured: dict[str, Any] = field(default_factory=dict)
    # Calibration files passed over on the way to this one: fitted for the model before the activation
    # factor (no ``activation_factor``), whose baseline and workspace factor mean something else.
    skipped: list[str] = field(default_factory=list)

    def warning(self, config: Config) -> str | None:
        """What the plan should warn about these constants for ``config`` (files passed over, another
        runtime), or None."""
        warnings = []
        if self.skipped:
            warnings.append(f"passed over {', '.join(self.skipped)} (made for the planner's earlier model; "
                            "rerun `bigmem-train plan --calibrate`)")
        mismatch = self.runtime_mismatch(config)
        if mismatch:
            warnings.append(mismatch)
        return "; ".join(warnings) or None

    def runtime_mismatch(self, config: Config) -> str | None:
        """Why these constants may not fit ``config``'s runtime (oneDNN switch, allocator), or None."""
        differences = []
        onednn = self.measured.get("onednn")
        if isinstance(onednn, bool) and onednn != config.runtime.onednn:
            differences.append(f"oneDNN {'on' if onednn else 'off'}")
        allocator = self.measured.get("allocator")
        if allocator and allocator != config.runtime.allocator:
            differences.append(f"allocator {allocator}")
        if not differences:
            return None
        return (f"fitted with {' and '.join(differences)}, this job runs with oneDNN "
                f"{'on' if config.runtime.onednn else 'off'} and {config.runtime.allocator}; "
                "rerun `bigmem-train plan --calibrate` with its runtime")


PACKAGED_CALIBRATION = Path(__file__).parent / "calibration.json"

# The memory model a calibration file's constants were fitted for (its "model" key): 1 had a workspace
# factor and no activation factor, 2 the activation factor, 3 also counts oneDNN's backward-weights
# scratchpad (``onednn_scratchpad_bytes``), which model 2's activation factor had absorbed.
MODEL_VERSION = 3


def _model_version(data: dict[str, Any]) -> int:
    if "activation_factor" not in data:
        return 1
    return int(data.get("model", 2))


def calibration_path_for_user() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration() -> Calibration:
    """$BIGMEM_CALIBRATION, else the user's ``~/.cache/bigmem-train/calibration.json``, else the packaged file.

    A file written by ``plan --calibrate`` for one of the planner's earlier models (``MODEL_VERSION``:
    without ``activation_factor``, or with a factor that also absorbed oneDNN's scratchpad) is passed
    over, and named in ``skipped`` so the plan can say so.
    """
    candidates = []
    if os.environ.get("BIGMEM_CALIBRATION"):
        candidates.append(Path(os.environ["BIGMEM_CALIBRATION"]))
    candidates += [calibration_path_for_user(), PACKAGED_CALIBRATION]
    skipped = []
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or _model_version(data) < MODEL_VERSION:
            skipped.append(str(path))
            continue
        return Calibration(
            runtime_baseline_bytes=int(data["runtime_baseline_bytes"]),
            activation_factor=float(data["activation_factor"]),
            workspace_factor=float(data["workspace_factor"]),
            source=str(path),
            measured=data.get("measured", {}),
            skipped=skipped,
        )
    return Calibration(skipped=skipped)


def expand_recomputed_blocks(table: list[dict[str, Any]], batch_norm: bool) -> list[dict[str, Any]]:
    """Replace each ``RecomputedBlock`` row (model.recompute) by the rows of the layers inside it.

    The block's last ReLU takes the block's name so its consumers still find it; the block's weights are
    counted once, on its first inner row. ``recomputed`` marks the inner rows.
    """
    rows = {row["name"]: row for row in table}
    expanded: list[dict[str, Any]] = []
    for row in table:
        if row["kind"] != "RecomputedBlock":
            expanded.append(row)
            continue
        name, filters = row["name"], row["channels"]
        common = {"divisor": row["divisor"], "dtype": row["dtype"], "kernel_dtype": row["kernel_dtype"],
                  "trainable_params": 0, "non_trainable_params": 0, "recomputed": True, "block": name}
        inner: list[dict[str, Any]] = []
        previous = row["inputs"][0]
        if len(row["inputs"]) == 2:  # an up block: upsample, concatenate with the skip
            skip = rows[row["inputs"][1]]
            kind, kernel = (("Conv3DTranspose", [2, 2, 2]) if row.get("upsampling", "transpose") == "transpose"
                            else ("UpSampling3D", []))
            inner.append({**common, "name": f"{name}_upsample", "kind": kind, "inputs": [previous],
                          "channels": filters, "activation": "linear", "kernel_size": kernel})
            inner.append({**common, "name": f"{name}_concat", "kind": "Concatenate",
                          "inputs": [f"{name}_upsample", skip["name"]], "channels": filters + skip["channels"],
                          "activation": None, "kernel_size": []})
            previous = f"{name}_concat"
        for index in (1, 2):
            inner.append({**common, "name": f"{name}_conv{index}", "kind": "Conv3D", "inputs": [previous],
                          "channels": filters, "activation": "linear", "kernel_size": [3, 3, 3]})
            previous = f"{name}_conv{index}"
            if batch_norm:
                inner.append({**common, "name": f"{name}_bn{index}", "kind": "BatchNormalization",
                              "inputs": [previous], "channels": filters, "activation": None, "kernel_size": []})
                previous = f"{name}_bn{index}"
            relu = name if index == 2 else f"{name}_relu{index}"
            inner.append({**common, "name": relu, "kind": "Activation", "inputs": [previous],
                          "channels": filters, "activation": "relu", "kernel_size": []})
            previous = relu
        inner[0]["trainable_params"] = row["trainable_params"]
        inner[0]["non_trainable_params"] = row["non_trainable_params"]
        expanded.extend(inner)
        rows.update({item["name"]: item for item in inner})
    return expanded


def _elements(row: dict[str, Any], batch: int, shape: tuple[int, int, int]) -> int:
    return batch * math.prod(edge // divisor for edge, divisor in zip(shape, row["divisor"])) * row["channels"]


def _block_of(name: str) -> str:
    """``down0_conv1`` -> ``down0``: the unit gradient recomputation treats as one (up blocks include
    their upsampling and concatenation, as model.RecomputedBlock does)."""
    return name.split("_", 1)[0]


CONVOLUTION_KINDS = {"Conv3D", "Conv3DTranspose", "Conv2D", "Dense"}


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
    - BatchNormalization (Keras 3, unfused: tf.nn.moments + tf.nn.batch_normalization) keeps its input in
      float32 (a float32 copy under mixed_bfloat16); the output is transient.
    - ReLU, sigmoid, softmax keep their output; MaxPool3D keeps its input and output; Concatenate and
      UpSampling keep nothing.
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


def backward_live_bytes(table: list[dict[str, Any]], batch: int, shape: tuple[int, int, int],
                        recompute: bool) -> tuple[int, int]:
    """(bytes kept for backward incl. the loss's, largest bytes of activations and activation gradients
    alive at once during backward), by walking the backward pass layer by layer.

    Walking the layers in reverse: a layer's backward reads the gradient of its output and writes one
    for each input (a tensor read by several layers sums its gradients, one extra buffer while adding);
    the gradient of a layer's output is freed after its backward, a kept tensor after the last backward
    that reads it. Under recomputation a block's internals are rebuilt while its layers run backward.
    """
    rows = {row["name"]: row for row in table}
    kept = kept_tensors(table, batch, shape)
    output = table[-1]
    kept.sizes["loss"] = LOSS_KEPT_TENSORS * _elements(output, batch, shape) * 4
    kept.readers["loss"] = {output["name"]}
    kept.owner["loss"] = _block_of(output["name"])
    internals = _recomputed_internals(table, kept) if recompute else {}
    kept_total = sum(kept.sizes.values())

    def gradient_bytes(row: dict[str, Any]) -> int:
        return _elements(row, batch, shape) * DTYPE_BYTES.get(row["dtype"], 4)

    pending = {key: set(readers) for key, readers in kept.readers.items() if key in kept.sizes}
    alive = dict(kept.sizes)
    gradients = {output["name"]: gradient_bytes(output)}
    peak = kept_total + gradients[output["name"]]
    for row in reversed(table):
        if row["kind"] == "InputLayer":
            continue
        adding = 0
        for name in row["inputs"]:
            producer = rows[name]
            if producer["kind"] == "InputLayer":
                continue  # no gradient for the data
            if name in gradients:
                adding += gradient_bytes(producer)
            else:
                gradients[name] = gradient_bytes(producer)
        rebuilt = sum(internals.get(row.get("block", ""), {}).values()) if row.get("recomputed") else 0
        peak = max(peak, sum(alive.values()) + sum(gradients.values()) + adding + rebuilt)
        gradients.pop(row["name"], None)
        for key in list(pending):
            pending[key].discard(row["name"])
            if not pending[key]:
                del pending[key], alive[key]
    return kept_total, peak


def _input_pipeline_bytes(config: Config, batch: int, shape: tuple[int, int, int]) -> int:
    """Batches in flight (the one in the step, the one being assembled, the prefetched ones) and the
    samples the parallel readers are preparing (the crop as read, the float32 image and label)."""
    sample_bytes = math.prod(shape) * (config.num_channels + 1) * 4
    batches = config.data.prefetch_batches + 2
    readers = PARALLEL_READS_AUTO if config.data.parallel_reads == "auto" else config.data.parallel_reads
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


# oneDNN's gemm-based backward-weights convolution (x64:gemm:jit, chosen for every 3x3x3 Conv3D with
# channels-last data) books its scratchpad per thread: a transposed copy of one input sample and the
# im2col matrix of one output depth slice (gemm_convolution_utils.cpp, init_conf, nspc bwd_w). It runs
# on one thread unless the slice is small (output rows per thread < 256) and the batch has more than
# one sample, and only then if the threads' copies stay under oneDNN's scratchpad limit (1 GiB).
ONEDNN_OUTER_THREADING_ROWS = 256
ONEDNN_SCRATCHPAD_LIMIT = 1 << 30


def onednn_scratchpad_bytes(table: list[dict[str, Any]], batch: int, shape: tuple[int, int, int],
                            threads: int = 1) -> int:
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
        if batch > 1 and threads > 1 and slice_outputs // threads < ONEDNN_OUTER_THREADING_ROWS \
                and threads * per_thread < ONEDNN_SCRATCHPAD_LIMIT:
            copies = threads
        largest = max(largest, copies * per_thread)
    return largest


def backward_concurrency(config: Config) -> int:
    """Column buffers alive at once: 1 with one inter-op thread (train.choose_threads' default); with more,
    a convolution's input-gradient and filter-gradient kernels run side by side, each with its own."""
    return min(2, config.runtime.inter_op_threads or 1)


def breakdown_for(config: Config, table: list[dict[str, Any]], calibration: Calibration,
                  batch: int, shape: tuple[int, int, int]) -> dict[str, int]:
    """The peak-memory breakdown of ``config``'s model at ``batch`` and ``shape`` (bytes per component)."""
    table = expand_recomputed_blocks(table, config.model.batch_norm)
    trainable = sum(row["trainable_params"] for row in table)
    non_trainable = sum(row["non_trainable_params"] for row in table)
    mixed = config.runtime.precision != "float32"
    # Variables are float32 even under mixed precision; then their bfloat16 casts live through the step.
    weights = (trainable + non_trainable) * 4 + (trainable * 2 if mixed else 0)
    gradients = trainable * 4 + (trainable * 2 if mixed else 0)
    optimizer_slots = trainable * 4 * ADAM_SLOTS
    kept, live = backward_live_bytes(table, batch, shape, config.model.recompute)
    factor = calibration.activation_factor
    activations = int(factor * kept)
    # The transient part of the peak: activation gradients (and a rebuilt block) alive with the kept
    # tensors at the backward peak; with TensorFlow's own Conv3D kernels their per-sample column buffer,
    # under oneDNN the largest backward-weights scratchpad, held from its first use on (docs/planner.md).
    column_buffers = scratchpad = 0
    if config.runtime.onednn:
        scratchpad = onednn_scratchpad_bytes(table, batch, shape,
                                             config.runtime.intra_op_threads or os.cpu_count() or 1)
    else:
        column_buffers = workspace_reference_bytes(table, batch, shape) * backward_concurrency(config)
    workspace = (int(factor * live) - activations + int(calibration.workspace_factor * column_buffers)
                 + scratchpad)
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer_slots": optimizer_slots,
        "activations": activations,
        "workspace": workspace,
        "input_pipeline": _input_pipeline_bytes(config, batch, shape),
        "runtime_baseline": calibration.runtime_baseline_bytes,
    }


def estimate(config: Config, calibration: Calibration | None = None) -> dict[str, int]:
    """Predicted peak-memory breakdown (bytes) of ``config`` as it stands: keys in ``BREAKDOWN_KEYS``."""
    calibration = calibration or load_calibration()
    return breakdown_for(config, layer_table(config), calibration,
                         config.training.batch_size, tuple(config.data.input_shape))


# --------------------------------------------------------------------------------------------------
# Sizing to a target.


def _peak(config: Config, table, calibration, batch: int, shape) -> int:
    return sum(breakdown_for(config, table, calibration, batch, tuple(shape)).values())


def largest_batch(config: Config, table, calibration, shape, limit_bytes: int,
                  ceiling: int = MAX_BATCH_SIZE) -> int:
    """Largest batch whose peak at ``shape`` is at most ``limit_bytes``; 0 when not even 1 fits."""
    if _peak(config, table, calibration, 1, shape) > limit_bytes:
        return 0
    low, high = 1, ceiling
    while low < high:
        middle = (low + high + 1) // 2
        if _peak(config, table, calibration, middle, shape) <= limit_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def largest_shape(config: Config, table, calibration, batch: int, limit_bytes: int,
                  ceiling: tuple[int, int, int] | None = None) -> tuple[int, int, int] | None:
    """Largest shape of the configured aspect (edges multiples of 2**depth, at most ``ceiling`` when given)
    whose peak at ``batch`` is at most ``limit_bytes``; None when not even the smallest fits."""
    step = 2 ** config.model.depth
    base = tuple(config.data.input_shape)

    def fits(shape) -> bool:
        return _peak(config, table, calibration, batch, shape) <= limit_bytes

    def scaled(factor: float) -> tuple[int, int, int]:
        shape = tuple(max(step, int(edge * factor) // step * step) for edge in base)
        if ceiling:
            shape = tuple(min(edge, top) for edge, top in zip(shape, ceiling))
        return shape  # type: ignore[return-value]

    if not fits(scaled(0.0)):
        return None
    low, high = 0.0, 64.0 if ceiling is None else 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if fits(scaled(middle)):
            low = middle
        else:
            high = middle
    shape = list(scaled(low))
    # Fill what is left one step on one axis at a time, the axis furthest below its share first.
    grown = True
    while grown:
        grown = False
        for axis in sorted(range(3), key=lambda a: shape[a] / base[a]):
            trial = list(shape)
            trial[axis] += step
            if ceiling and trial[axis] > ceiling[axis]:
                continue
            if fits(trial):
                shape, grown = trial, True
                break
    return tuple(shape)  # type: ignore[return-value]


def size_to_target(config: Config, target_bytes: int, table, calibration) -> tuple[int, tuple[int, int, int]]:
    """(batch, shape) whose predicted peak comes closest to ``target_bytes`` from below, per footprint.resize.

    "batch" keeps the shape; "shape" keeps the batch; "both" keeps the shape and picks the batch, then
    tries one batch more on a shape shrunk to fit, and takes whichever comes closer (the shape never grows
    beyond the configured one, so crops stay inside the volumes). When nothing fits, the smallest job.
    """
    shape = tuple(config.data.input_shape)
    batch = config.training.batch_size
    mode = config.footprint.resize
    if mode == "batch":
        return max(1, largest_batch(config, table, calibration, shape, target_bytes)), shape
    if mode == "shape":
        found = largest_shape(config, table, calibration, batch, target_bytes)
        step = 2 ** config.model.depth
        return batch, found or (step, step, step)
    best_batch = largest_batch(config, table, calibration, shape, target_bytes)
    if best_batch == 0:
        found = largest_shape(config, table, calibration, 1, target_bytes, ceiling=shape)
        step = 2 ** config.model.depth
        return 1, found or (step, step, step)
    candidates = [(best_batch, shape)]
    more = (largest_shape(config, table, calibration, best_batch + 1, target_bytes, ceiling=shape)
            if best_batch < MAX_BATCH_SIZE else None)
    if more:
        candidates.append((best_batch + 1, more))
    return max(candidates, key=lambda c: (_peak(config, table, calibration, c[0], c[1]), c[1] == shape))


# --------------------------------------------------------------------------------------------------
# NUMA placement.


@dataclass
class Placement:
    """Where the job's memory and threads go. ``policy``: bind (one node, its cores), interleave, none."""

    policy: Literal["bind", "interleave", "none"]
    nodes: list[int]
    cpus: list[int]
    reason: str
    all_memory_nodes: bool = False

    def numactl_args(self) -> list[str]:
        """The numactl prefix to re-execute the job under ([] for none)."""
        if self.policy == "bind":
            joined = ",".join(map(str, self.nodes))
            return ["numactl", f"--membind={joined}", f"--cpunodebind={joined}"]
        if self.policy == "interleave":
            nodes = "all" if self.all_memory_nodes else ",".join(map(str, self.nodes))
            return ["numactl", f"--interleave={nodes}"]
        return []

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "nodes": self.nodes, "cpus": self.cpus, "reason": self.reason,
                "numactl": self.numactl_args()}


def decide_placement(peak_bytes: int, host: HostFacts, numa_policy: str, safety_margin: float) -> Placement:
    """Bind to one node with CPUs when the job fits its available memory with the margin, else interleave.

    Memory-only nodes (no CPUs: CXL expanders, persistent memory) are never bound to; they join an
    interleave only when the nodes with CPUs together cannot hold the job.
    """
    nodes = [node for node in host.numa_nodes if node.memory_total_bytes > 0]
    usable = set(host.usable_cpus)
    if len(nodes) <= 1:
        return Placement("none", [node.node_id for node in nodes], sorted(usable), "one NUMA node: nothing to place")
    if numa_policy == "none":
        return Placement("none", [], sorted(usable), "numa_policy is none: the kernel's default placement")
    keep = 1.0 - safety_margin

    def node_cpus(node) -> list[int]:
        return sorted(set(node.cpus) & usable) if usable else list(node.cpus)

    with_cpus = [node for node in nodes if node_cpus(node)]
    if numa_policy in {"auto", "bind"}:
        fitting = [node for node in with_cpus if peak_bytes <= node.memory_available_bytes * keep]
        if fitting:
            node = max(fitting, key=lambda n: (n.memory_available_bytes, -n.node_id))
            return Placement(
                "bind", [node.node_id], node_cpus(node),
                f"fits node {node.node_id}: {format_bytes(peak_bytes)} <= {keep:.0%} of its available "
                f"{format_bytes(node.memory_available_bytes)}; memory and cores bound to it",
            )
    prefix = "bind requested but no node with CPUs holds the job; " if numa_policy == "bind" else ""
    cpu_memory = sum(node.memory_available_bytes for node in with_cpus)
    cpus = sorted({cpu for node in with_cpus for cpu in node_cpus(node)})
    if peak_bytes <= cpu_memory * keep or len(with_cpus) == len(nodes):
        chosen = with_cpus
        reason = (f"{prefix}larger than any one node; interleaved over the {len(chosen)} nodes with CPUs "
                  f"({format_bytes(cpu_memory)} available)")
    else:
        chosen = nodes
        reason = (f"{prefix}larger than the nodes with CPUs hold ({format_bytes(cpu_memory)} available); "
                  f"interleaved over all {len(nodes)} nodes incl. memory-only ones")
    return Placement("interleave", [node.node_id for node in chosen], cpus, reason,
                     all_memory_nodes=len(chosen) == len(nodes))


# --------------------------------------------------------------------------------------------------
# The plan.


@dataclass
class JobPlan:
    """The job after sizing, its predicted peak and breakdown, and its placement."""

    config: Config
    peak_bytes: int
    breakdown: dict[str, int]
    target_bytes: int | None
    placement: Placement
    original_batch_size: int = 0
    original_input_shape: tuple[int, int, int] = (0, 0, 0)
    calibration_source: str = ""
    # Set when the constants were fitted under another runtime (oneDNN switch, allocator) than this job's,
    # or a calibration file was passed over (``Calibration.warning``).
    calibration_warning: str | None = None
    # Multi-worker: the plan is per host (one replica and its share of the global batch each).
    workers: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "batch_size_per_worker": self.config.training.batch_size // self.workers,
            "peak_bytes": self.peak_bytes,
            "peak_gib": gib(self.peak_bytes),
            "target_bytes": self.target_bytes,
            "target_gib": gib(self.target_bytes) if self.target_bytes is not None else None,
            "batch_size": self.config.training.batch_size,
            "input_shape": list(self.config.data.input_shape),
            "original_batch_size": self.original_batch_size,
            "original_input_shape": list(self.original_input_shape),
            "precision": self.config.runtime.precision,
            "recompute": self.config.model.recompute,
            "breakdown": {key: {"bytes": value, "gib": gib(value)} for key, value in self.breakdown.items()},
            "placement": self.placement.to_dict(),
            "calibration": self.calibration_source,
            "calibration_warning": self.calibration_warning,
        }


def resolve_target(config: Config, host: HostFacts | None) -> int | None:
    """footprint.target in bytes ("80%" of the memory the job may see on ``host``)."""
    if config.footprint.target is None:
        return None
    total = host.limit_total_bytes if host is not None else None
    return parse_size(config.footprint.target, host_total_bytes=total)


def with_job_size(config: Config, batch: int, shape: tuple[int, int, int]) -> Config:
    """A copy of ``config`` with this batch and input shape (validated)."""
    data = config.model_dump()
    data["training"]["batch_size"] = batch
    data["data"]["input_shape"] = tuple(shape)
    return Config.model_validate(data)


def plan_job(config: Config, host: HostFacts | None, calibration: Calibration | None = None) -> JobPlan:
    """Size ``config`` to footprint.target (if any), predict its peak and decide its NUMA placement."""
    from .distribute import per_worker_batch_size, planned_workers

    calibration = calibration or load_calibration()
    table = layer_table(config)
    target = resolve_target(config, host)
    # A multi-worker job is planned per host: each worker holds a whole replica and computes
    # batch_size / workers samples; the target is per host too.
    workers = planned_workers(config)
    per_host = with_job_size(config, per_worker_batch_size(config, workers), tuple(config.data.input_shape))
    sized = config
    if target is not None:
        batch, shape = size_to_target(per_host, target, table, calibration)
        sized = with_job_size(config, batch * workers, shape)
    breakdown = breakdown_for(sized, table, calibration, sized.training.batch_size // workers,
                              tuple(sized.data.input_shape))
    if workers > 1:
        # The all-reduce packs the gradients into buffers of their size once more.
        breakdown["allreduce_buffers"] = breakdown["gradients"]
    peak = sum(breakdown.values())
    if target is not None and peak > target * (1 + config.footprint.tolerance):
        # Sizing fell back to the smallest job it may make, and even that misses the target: a run
        # would train and then fail its footprint check, so the target is refused before any work.
        shape = "x".join(map(str, sized.data.input_shape))
        raise BadInput(
            f"footprint.target {format_bytes(target)} is below the smallest job this config can be sized to "
            f"(resize: {config.footprint.resize}): input {shape}, batch {sized.training.batch_size} is predicted "
            f"at {format_bytes(peak)}; set a target of at least that")
    if host is not None:
        placement = decide_placement(peak, host, config.runtime.numa_policy, config.footprint.safety_margin)
    else:
        placement = Placement("none", [], [], "no host facts")
    return JobPlan(sized, peak, breakdown, target, placement, config.training.batch_size,
                   tuple(config.data.input_shape), calibration.source, calibration.warning(config),
                   workers)


def format_plan(plan: JobPlan) -> str:
    """The human-readable plan: breakdown in bytes and GiB, the chosen job, the placement."""
    config = plan.config
    lines = [
        f"job: input {'x'.join(map(str, config.data.input_shape))} x {config.num_channels} channel(s), "
        f"batch {config.training.batch_size}, {config.model.base_filters} base filters, depth {config.model.depth}, "
        f"{config.runtime.precision}{', recompute' if config.model.recompute else ''}",
    ]
    if plan.target_bytes is not None:
        lines.append(f"target: {format_bytes(plan.target_bytes)} (resize: {config.footprint.resize}; was input "
                     f"{'x'.join(map(str, plan.original_input_shape))}, batch {plan.original_batch_size})")
    if plan.workers > 1:
        lines.append(f"multi-worker: {plan.workers} hosts, each one replica with batch "
                     f"{config.training.batch_size // plan.workers}; the figures below are per host")
    lines.append("predicted peak memory:")
    width = max(len(key) for key in plan.breakdown)
    for key, value in plan.breakdown.items():
        lines.append(f"  {key:<{width}}  {format_bytes(value)}")
    lines.append(f"  {'total':<{width}}  {format_bytes(plan.peak_bytes)}")
    voxels = config.training.batch_size // plan.workers * config.voxels_per_sample
    lines.append(f"per input voxel: {plan.breakdown['activations'] / voxels:.0f} B for the activations kept for "
                 "backward, "
                 f"{plan.peak_bytes / voxels:.0f} B in all")
    lines.append(f"placement: {plan.placement.policy} ({plan.placement.reason})")
    if plan.placement.numactl_args():
        lines.append(f"  {' '.join(plan.placement.numactl_args())}")
    lines.append(f"constants: {plan.calibration_source}")
    if plan.calibration_warning:
        lines.append(f"  warning: {plan.calibration_warning}")
    return "\n".join(lines)


def plan_command(config: Config, as_json: bool, calibrate: bool) -> int:
    """``bigmem-train plan``: print the breakdown (and the sized job with a target)."""
    from .host import read_host_facts

    if calibrate:
        from .calibration import calibrate as run_calibration  # imports nothing heavy; children train

        path = run_calibration(config, log=None if as_json else print)
        if not as_json:
            print(f"calibration stored: {path}")
    host = read_host_facts()
    plan = plan_job(config, host)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan))
    return 0


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--layer-table"]:
        config = Config.model_validate_json(sys.stdin.read())
        print(json.dumps(layer_table_from_keras(config)))
        return 0
    print("usage: python -m bigmem_train.planner --layer-table < config.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
