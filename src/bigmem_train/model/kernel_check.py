"""Which oneDNN kernel each Conv3D's filter gradient gets on this CPU; a warning for reference kernels.

Two sources, one checked against the other:

* the known limit (``conv.gemm_backward_weights_fits``: oneDNN's gemm backward-weights scratchpad
  booking, read from its source), applied to every convolution as the kit runs it (a chunked layer by
  its chunk), free and instant;
* a probe: a child process with ``ONEDNN_VERBOSE=profile_create`` runs the filter gradient of given
  convolutions and reports the implementation oneDNN created for each. It is killed as soon as a
  reference kernel is created, so probing a shape past the cliff costs its allocation, not minutes.
  :func:`backward_weights_family` probes one small convolution to learn which kernel family this CPU
  uses for channels-last filter gradients (``x64:gemm:jit`` without AVX-512, ``jit:avx512_core`` with
  it); the limit only applies to the gemm family.

``check_model`` combines them and ``warn_reference_kernels`` prints one warning per convolution that
would run the reference kernel, with the layer name and the expected slowdown.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bigmem_train.model.conv import (
    ConvGeometry,
    gemm_backward_weights_fits,
    gemm_backward_weights_scratchpad_bytes,
    slab_geometry,
)

GEMM_FAMILY = "x64:gemm:jit"
MARKER = "bigmem_probe"
# A lower bound on how much slower oneDNN's ref:any filter gradient is than x64:gemm:jit on the same
# layer (benchmarks/onednn_cliff.py --sections time, docs/design/performance.md): the study's up0_conv1 under
# ONEDNN_MAX_CPU_ISA=AVX2 had not finished after 268 s on ref:any; in chunks on gemm it took 38 s.
REFERENCE_SLOWDOWN = 7


@dataclass
class ConvCheck:
    """One Conv3D of a model as the kit runs it."""

    layer: str
    geometry: ConvGeometry
    chunk: int | None  # output planes per filter-gradient chunk; None: whole
    scratchpad_bytes: int  # gemm backward-weights scratchpad of the convolution as run
    gemm_fits: bool  # under oneDNN's gemm scratchpad limit
    implementation: str  # expected backward-weights implementation on this CPU

    @property
    def reference(self) -> bool:
        return self.implementation.startswith("ref")


def _probe_env(overrides: dict[str, str] | None) -> dict[str, str]:
    env = dict(
        os.environ, TF_ENABLE_ONEDNN_OPTS="1", ONEDNN_VERBOSE="profile_create", TF_CPP_MIN_LOG_LEVEL="3"
    )
    env.pop("DNNL_VERBOSE", None)
    # The child imports this package from where this process has it (a source tree need not be installed).
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.update(overrides or {})
    return env


def _parse_create(line: str) -> tuple[str, str] | None:
    """(implementation, problem) of a oneDNN verbose create line for a backward-weights convolution."""
    fields = line.strip().split(",")
    if (
        len(fields) < 9
        or not fields[0].endswith("_verbose")
        or not any(f.startswith("create") for f in fields)
    ):
        return None
    try:
        index = fields.index("convolution")
    except ValueError:
        return None
    if fields[index + 2] != "backward_weights":
        return None
    problem = next((field for field in fields if field.startswith("mb")), "")
    return fields[index + 1], problem


def probe_backward_weights(
    geometries: list[ConvGeometry], batch: int = 1, env: dict[str, str] | None = None, timeout: float = 600
) -> list[tuple[str, str]]:
    """(implementation, oneDNN problem string) that oneDNN creates for the filter gradient of each
    geometry, in a child process (``env`` overrides its environment, e.g. ``ONEDNN_MAX_CPU_ISA``).

    The child runs the gradients one after another; a reference kernel is not waited for: the child is
    killed and a fresh one continues with the next geometry."""
    results: list[tuple[str, str]] = []
    while len(results) < len(geometries):
        pending = geometries[len(results) :]
        spec = json.dumps(
            {
                "batch": batch,
                "geometries": [
                    [list(g.spatial), g.in_channels, g.out_channels, list(g.kernel), g.padding, g.dtype_bytes]
                    for g in pending
                ],
            }
        )
        child = subprocess.Popen(
            [sys.executable, "-m", "bigmem_train.model.kernel_check", spec],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_probe_env(env),
        )
        current = None
        restarted = False
        try:
            for line in child.stdout:
                if line.startswith(MARKER):
                    current = int(line.split(",")[1])
                    continue
                created = _parse_create(line)
                if (
                    created is None
                    or current is None
                    or len(results) != len(geometries) - len(pending) + current
                ):
                    continue
                results.append(created)
                if created[0].startswith("ref") and len(results) < len(geometries):
                    restarted = True
                    break
                if len(results) == len(geometries):
                    break  # the last one was created: its run (reference or not) is not needed
        finally:
            child.kill()  # this child only, by its PID
            _, stderr = child.communicate(timeout=timeout)
        if not restarted and len(results) < len(geometries):
            tail = (stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(f"oneDNN probe ended before creating a backward-weights kernel: {tail}")
    return results


@functools.cache
def backward_weights_family() -> str:
    """The implementation this CPU's oneDNN gives a small channels-last Conv3D filter gradient."""
    return probe_backward_weights([ConvGeometry((8, 8, 8), 8, 8)], timeout=300)[0][0]


def _conv_layers(model):
    """Every Conv3D of ``model`` (nested ones included) with its per-sample input shape."""
    import keras

    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not isinstance(layer, keras.layers.Conv3D):
            continue
        shapes = getattr(layer, "_build_shapes_dict", None) or {}
        shape = next(iter(shapes.values()), None)
        if shape is None:
            continue
        yield layer, tuple(shape)


def check_model(model, family: str | None = None) -> list[ConvCheck]:
    """Each stride-1 Conv3D of ``model`` with the filter-gradient implementation it is expected to get on
    this CPU (``family``: this CPU's kernel family, probed when not given and needed)."""
    from bigmem_train.model.conv import ChunkedConv3D

    checks = []
    for layer, shape in _conv_layers(model):
        if any(s != 1 for s in layer.strides) or any(d != 1 for d in layer.dilation_rate):
            continue
        dtype_bytes = 2 if layer.compute_dtype in ("bfloat16", "float16") else 4
        geometry = ConvGeometry(
            tuple(int(e) for e in shape[1:4]),
            int(shape[-1]),
            layer.filters,
            tuple(layer.kernel_size),
            layer.padding,
            dtype_bytes,
        )
        chunk = layer.depth_chunk(shape) if isinstance(layer, ChunkedConv3D) else None
        as_run = geometry if chunk is None else slab_geometry(geometry, chunk)
        checks.append(
            ConvCheck(
                layer.name,
                geometry,
                chunk,
                gemm_backward_weights_scratchpad_bytes(as_run),
                gemm_backward_weights_fits(as_run),
                "",
            )
        )
    for check in checks:
        if check.gemm_fits:
            check.implementation = family or "fast (gemm scratchpad under the limit)"
            continue
        family = family or backward_weights_family()
        check.implementation = "ref:any" if family == GEMM_FAMILY else family
    return checks


def warn_reference_kernels(checks: list[ConvCheck]) -> list[str]:
    """Print (and return) one warning per convolution expected on oneDNN's reference kernel."""
    warnings = []
    for check in checks:
        if not check.reference:
            continue
        g = check.geometry
        message = (
            f"layer {check.layer} (Conv3D {'x'.join(map(str, g.spatial))}, {g.in_channels} -> "
            f"{g.out_channels} channels): oneDNN gives its filter gradient the reference kernel "
            f"ref:any on this CPU (gemm scratchpad {check.scratchpad_bytes / 2**30:.2f} GiB > 1 GiB "
            f"limit); expect that gradient at least {REFERENCE_SLOWDOWN}x slower than x64:gemm:jit"
        )
        print(f"bigmem-train: warning: {message}", file=sys.stderr, flush=True)
        warnings.append(message)
    return warnings


def _child(spec_json: str) -> None:
    import tensorflow as tf

    spec = json.loads(spec_json)
    batch = spec["batch"]
    for index, (spatial, cin, cout, kernel, padding, dtype_bytes) in enumerate(spec["geometries"]):
        dtype = tf.bfloat16 if dtype_bytes == 2 else tf.float32
        geometry = ConvGeometry(tuple(spatial), cin, cout, tuple(kernel), padding, dtype_bytes)
        x = tf.zeros([batch, *spatial, cin], dtype)
        dy = tf.zeros([batch, *geometry.output_spatial, cout], dtype)

        tf_padding = padding.upper()

        @tf.function
        def filter_gradient(x, dy, sizes=(*kernel, cin, cout), padding=tf_padding):
            return tf.raw_ops.Conv3DBackpropFilterV2(
                input=x, filter_sizes=list(sizes), out_backprop=dy, strides=[1] * 5, padding=padding
            )

        print(f"{MARKER},{index},{math.prod(spatial) * cin}", flush=True)
        filter_gradient(x, dy).numpy()
        del x, dy


if __name__ == "__main__":
    _child(sys.argv[1])
