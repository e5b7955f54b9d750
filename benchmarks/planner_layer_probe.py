"""What single layers allocate: the transient resident memory of one forward + backward call of one
Keras layer, at batch 1 and 2, under the runtime a real run has (oneDNN switch, allocator preloaded).

Each call is measured as the rise of the RSS high-water mark (VmHWM, reset with clear_refs) over the
RSS before it, after the allocator's free memory was handed back (tcmalloc ReleaseFreeMemory, glibc
malloc_trim), so memory kept from the previous call does not hide the allocation. Three calls per case:
the first includes tracing and oneDNN primitive creation. A convolution that built an im2col patch
matrix would show 27 x input channels x voxels x 4 B (216 MiB for 8 channels at 64^3). Under tcmalloc,
``retained_MiB`` is what stays allocated after the three calls (its allocated-bytes counter after minus
before): memory the kernels keep from one call to the next.

    python benchmarks/planner_layer_probe.py                  # conv, convT, batch norm, ReLU, max pool
    python benchmarks/planner_layer_probe.py --layers conv --onednn false --allocator glibc
    python benchmarks/planner_layer_probe.py --precision mixed_bfloat16   # layers fed bf16, as mid-model
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

LAYERS = ("conv", "conv_bn_relu", "bn", "relu", "pool", "convT")


def _gradient_step(tf, model, data):
    """One forward and backward pass of ``model`` on ``data`` as a tf.function (the input's gradient too)."""

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(data, training=True))
        return tape.gradient(loss, [data, *model.trainable_variables])

    return step


def _release_and_reset() -> None:
    from bigmem_train.memory.calibrate import reset_peak

    library = ctypes.CDLL(None)
    if hasattr(library, "MallocExtension_ReleaseFreeMemory"):
        library.MallocExtension_ReleaseFreeMemory()
    elif hasattr(library, "malloc_trim"):
        library.malloc_trim(0)
    reset_peak()


def tcmalloc_stats() -> dict[str, int]:
    """gperftools' heap counters (bytes) when tcmalloc is preloaded, else {}."""
    import ctypes

    try:
        get = ctypes.CDLL(None).MallocExtension_GetNumericProperty
    except (OSError, AttributeError):
        return {}
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    value = ctypes.c_size_t(0)
    if not get(b"generic.current_allocated_bytes", ctypes.byref(value)):
        return {}
    return {"current_allocated_bytes": int(value.value)}


def probe(layers: list[str], shape: tuple[int, int, int], channels: int, precision: str = "float32") -> None:
    """The child's side: one JSON line per layer with the rise in MiB of each call at batch 1 and 2."""
    import gc

    import keras
    import tensorflow as tf

    from bigmem_train.memory.calibrate import status_bytes
    from bigmem_train.model.unet import batch_norm_layer

    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("PROBE_INTRA", "2")))
    # As a single-host run does: every op inline in the calling thread (launch.INLINE_OPS).
    tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("PROBE_INTER", "-1")))

    keras.mixed_precision.set_global_policy(precision)
    # Under a mixed policy a layer in the middle of the model is fed its predecessor's compute dtype.
    dtype = keras.mixed_precision.global_policy().compute_dtype

    def build(kind: str) -> keras.Model:
        x = keras.Input((*shape, channels), dtype=dtype)
        y = x
        if kind in ("conv", "conv_bn_relu"):
            y = keras.layers.Conv3D(channels, 3, padding="same")(y)
        if kind in ("bn", "conv_bn_relu"):
            # The kit's batch normalization (fused kernel, norm.py) unless BIGMEM_BATCH_NORM=keras.
            y = batch_norm_layer()(y)
        if kind in ("relu", "conv_bn_relu"):
            y = keras.layers.Activation("relu")(y)
        if kind == "pool":
            y = keras.layers.MaxPooling3D()(y)
        if kind == "convT":
            y = keras.layers.Conv3DTranspose(channels, 2, strides=2)(y)
        return keras.Model(x, y)

    tensor_mib = 1
    for edge in shape:
        tensor_mib *= edge
    tensor_mib = tensor_mib * channels * 4 / 2**20
    for kind in layers:
        result = {
            "layer": kind,
            "shape": list(shape),
            "channels": channels,
            "input_MiB_per_sample": tensor_mib,
            "precision": precision,
        }
        for batch in (1, 2):
            model = build(kind)
            data = tf.Variable(tf.cast(tf.random.normal((batch, *shape, channels)), dtype))

            step = _gradient_step(tf, model, data)
            rises = []
            gc.collect()
            allocated_before = tcmalloc_stats().get("current_allocated_bytes")
            for _ in range(3):
                _release_and_reset()
                before = status_bytes("VmRSS")
                gradients = step()
                gradients[0].numpy().ravel()[:1]
                rises.append(round((status_bytes("VmHWM") - before) / 2**20, 1))
                del gradients
            result[f"batch{batch}_MiB"] = rises
            gc.collect()
            if allocated_before is not None:
                retained = tcmalloc_stats()["current_allocated_bytes"] - allocated_before
                result[f"batch{batch}_retained_MiB"] = round(retained / 2**20, 1)
            del data, model
        print(json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    parser.add_argument("--shape", default="64,64,64")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--onednn", default="true", choices=["true", "false"])
    parser.add_argument("--allocator", default="tcmalloc", choices=["glibc", "jemalloc", "tcmalloc"])
    parser.add_argument("--precision", default="float32", choices=["float32", "mixed_bfloat16"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(edge) for edge in args.shape.split(","))
    if args.child:
        probe(args.layers.split(","), shape, args.channels, args.precision)  # type: ignore[arg-type]
        return 0
    from bigmem_train.config import load_config
    from bigmem_train.train.launch import runtime_environment

    config = load_config(None, {"runtime.onednn": args.onednn == "true", "runtime.allocator": args.allocator})
    environment = dict(runtime_environment(config), TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], env=environment).returncode


if __name__ == "__main__":
    sys.exit(main())
