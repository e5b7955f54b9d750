"""The layer table: what the configured Keras U-Net is made of, independent of batch and shape.

``layer_table`` builds the model (``model.build_unet``) once and records, layer by layer, its kind, inputs,
output channels, spatial down-sampling and dtype; edges are divisible by ``2**depth``, so sizing a job from
the table is arithmetic. The table is built in a child process (importing TensorFlow takes seconds and must
not happen before the launcher re-executes under numactl) and cached under ``cache_dir()``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bigmem_train.config import Config
from bigmem_train.errors import BadInput

# Bumped when the table gains a field, so cached tables are rebuilt.
TABLE_VERSION = 3


def _model_source_digest() -> str:
    """A digest of the model package's source: a table recorded from another model is rebuilt."""
    digest = hashlib.sha256()
    for source in sorted((Path(__file__).parents[1] / "model").glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


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

    from bigmem_train.model.unet import build_unet

    edge = 2**config.model.depth * 2
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
                # The kit's fused batch normalization is Keras' layer to the planner's rules (estimate.py).
                "kind": "BatchNormalization"
                if isinstance(layer, keras.layers.BatchNormalization)
                else type(layer).__name__,
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
            [sys.executable, "-m", "bigmem_train.memory.layers", "--layer-table"],
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
        common = {
            "divisor": row["divisor"],
            "dtype": row["dtype"],
            "kernel_dtype": row["kernel_dtype"],
            "trainable_params": 0,
            "non_trainable_params": 0,
            "recomputed": True,
            "block": name,
        }
        inner: list[dict[str, Any]] = []
        previous = row["inputs"][0]
        if len(row["inputs"]) == 2:  # an up block: upsample, concatenate with the skip
            skip = rows[row["inputs"][1]]
            kind, kernel = (
                ("Conv3DTranspose", [2, 2, 2])
                if row.get("upsampling", "transpose") == "transpose"
                else ("UpSampling3D", [])
            )
            inner.append(
                {
                    **common,
                    "name": f"{name}_upsample",
                    "kind": kind,
                    "inputs": [previous],
                    "channels": filters,
                    "activation": "linear",
                    "kernel_size": kernel,
                }
            )
            inner.append(
                {
                    **common,
                    "name": f"{name}_concat",
                    "kind": "Concatenate",
                    "inputs": [f"{name}_upsample", skip["name"]],
                    "channels": filters + skip["channels"],
                    "activation": None,
                    "kernel_size": [],
                }
            )
            previous = f"{name}_concat"
        for index in (1, 2):
            inner.append(
                {
                    **common,
                    "name": f"{name}_conv{index}",
                    "kind": "Conv3D",
                    "inputs": [previous],
                    "channels": filters,
                    "activation": "linear",
                    "kernel_size": [3, 3, 3],
                }
            )
            previous = f"{name}_conv{index}"
            if batch_norm:
                inner.append(
                    {
                        **common,
                        "name": f"{name}_bn{index}",
                        "kind": "BatchNormalization",
                        "inputs": [previous],
                        "channels": filters,
                        "activation": None,
                        "kernel_size": [],
                    }
                )
                previous = f"{name}_bn{index}"
            relu = name if index == 2 else f"{name}_relu{index}"
            inner.append(
                {
                    **common,
                    "name": relu,
                    "kind": "Activation",
                    "inputs": [previous],
                    "channels": filters,
                    "activation": "relu",
                    "kernel_size": [],
                }
            )
            previous = relu
        inner[0]["trainable_params"] = row["trainable_params"]
        inner[0]["non_trainable_params"] = row["non_trainable_params"]
        expanded.extend(inner)
        rows.update({item["name"]: item for item in inner})
    return expanded


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--layer-table"]:
        config = Config.model_validate_json(sys.stdin.read())
        print(json.dumps(layer_table_from_keras(config)))
        return 0
    print("usage: python -m bigmem_train.memory.layers --layer-table < config.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
