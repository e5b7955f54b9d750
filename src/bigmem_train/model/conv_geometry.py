"""The geometry of oneDNN's Conv3D backward-weights limit and of the depth chunks that stay under it, with
no TensorFlow or Keras import: the planner prices a chunked layer's copies before TensorFlow is loaded
(``conv`` builds the layer on top of this). The cliff and the fix are described in ``conv``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from bigmem_train.host import AVX512_CORE_FLAGS, this_cpu_flags

# gemm_convolution_utils.cpp: scratchpad_limit_by_absolute_value.
ONEDNN_SCRATCHPAD_LIMIT_BYTES = 1 << 30
# memory_tracking.hpp: every booked buffer is padded by its alignment (default_alignment = 128).
ONEDNN_BOOKING_ALIGNMENT = 128
# Chunks are sized to stay this far under the limit, for booking details of other oneDNN versions.
CHUNK_HEADROOM_BYTES = 32 << 20


@dataclass(frozen=True)
class ConvGeometry:
    """One stride-1, undilated 3D convolution on channels-last data, per sample."""

    spatial: tuple[int, int, int]  # input D, H, W (TensorFlow's NDHWC order = oneDNN's id, ih, iw)
    in_channels: int
    out_channels: int
    kernel: tuple[int, int, int] = (3, 3, 3)
    padding: str = "same"
    dtype_bytes: int = 4

    @property
    def output_spatial(self) -> tuple[int, int, int]:
        if self.padding == "same":
            return self.spatial
        return tuple(edge - k + 1 for edge, k in zip(self.spatial, self.kernel))


def gemm_backward_weights_scratchpad_bytes(geometry: ConvGeometry, threads: int = 1) -> int:
    """Bytes oneDNN's ``x64:gemm:jit`` backward-weights convolution books for ``geometry`` on channels-last
    data with ``threads`` threads working on separate samples (1 for large slices: see
    :func:`gemm_backward_weights_threads`). Follows init_conf's nspc bwd_w branch booking by booking."""
    kernel_volume = math.prod(geometry.kernel)
    _, out_h, out_w = geometry.output_spatial
    size = geometry.dtype_bytes
    trivial = kernel_volume == 1 and geometry.output_spatial == geometry.spatial
    im2col = 0 if trivial else geometry.in_channels * kernel_volume * out_h * out_w * size
    weights_bytes = 4 * geometry.out_channels * geometry.in_channels * kernel_volume
    reduction = 4 * weights_bytes  # scratchpad.book<float>(key_conv_wei_reduction, nthr * weights_d.size())
    transposed_input = geometry.in_channels * math.prod(geometry.spatial) * size
    return sum(
        threads * part + ONEDNN_BOOKING_ALIGNMENT for part in (im2col, reduction, transposed_input) if part
    )


def gemm_backward_weights_threads(geometry: ConvGeometry, batch: int, threads: int) -> int:
    """oneDNN's ``jcp.nthr`` for this kernel: all threads (one sample each) only when a batch of several
    samples has small output slices (rows per thread < 256) and the threads' copies fit the limit."""
    _, out_h, out_w = geometry.output_spatial
    if batch == 1 or threads == 1 or (out_h * out_w) // threads >= 256:
        return 1
    per_thread = gemm_backward_weights_scratchpad_bytes(geometry, 1)
    return threads if threads * per_thread < ONEDNN_SCRATCHPAD_LIMIT_BYTES else 1


def gemm_backward_weights_limit(geometry: ConvGeometry, batch: int, threads: int) -> int:
    """The scratchpad limit init_conf applies: min(1 GiB, 15 x threads x (src + weights + dst bytes))."""
    src = batch * geometry.in_channels * math.prod(geometry.spatial) * geometry.dtype_bytes
    dst = batch * geometry.out_channels * math.prod(geometry.output_spatial) * geometry.dtype_bytes
    weights = geometry.out_channels * geometry.in_channels * math.prod(geometry.kernel) * geometry.dtype_bytes
    return min(ONEDNN_SCRATCHPAD_LIMIT_BYTES, 15 * threads * (src + weights + dst))


def gemm_backward_weights_fits(geometry: ConvGeometry, batch: int = 1, threads: int = 1) -> bool:
    """Whether oneDNN's gemm backward-weights kernel accepts this convolution (else: ``ref:any``)."""
    nthr = gemm_backward_weights_threads(geometry, batch, threads)
    return gemm_backward_weights_scratchpad_bytes(geometry, nthr) <= gemm_backward_weights_limit(
        geometry, batch, threads
    )


def _halo(kernel_depth: int, padding: str) -> tuple[int, int]:
    """Input planes a chunk reads before its first and after its last output plane."""
    if padding == "same":
        front = (kernel_depth - 1) // 2
        return front, kernel_depth - 1 - front
    return 0, kernel_depth - 1


def slab_geometry(geometry: ConvGeometry, chunk: int) -> ConvGeometry:
    """The convolution one depth chunk of ``chunk`` output planes runs (its input slab has the halo)."""
    front, back = _halo(geometry.kernel[0], geometry.padding)
    depth, height, width = geometry.spatial
    return ConvGeometry(
        (min(depth, chunk + front + back), height, width),
        geometry.in_channels,
        geometry.out_channels,
        geometry.kernel,
        geometry.padding,
        geometry.dtype_bytes,
    )


def plan_depth_chunk(geometry: ConvGeometry, limit_bytes: int | None = None) -> int | None:
    """Output planes per chunk that keep the filter gradient on the gemm kernel, or None when the whole
    convolution already fits (no chunking). Raises ValueError when not even one plane fits."""
    limit = ONEDNN_SCRATCHPAD_LIMIT_BYTES - CHUNK_HEADROOM_BYTES if limit_bytes is None else limit_bytes
    if gemm_backward_weights_scratchpad_bytes(geometry) <= limit:
        return None
    out_depth = geometry.output_spatial[0]
    # Fewest equal chunks whose slab fits: the scratchpad grows linearly with the slab depth.
    for pieces in range(2, out_depth + 1):
        chunk = math.ceil(out_depth / pieces)
        if gemm_backward_weights_scratchpad_bytes(slab_geometry(geometry, chunk)) <= limit:
            return chunk
    raise ValueError(
        f"a Conv3D on {geometry.spatial} x {geometry.in_channels} channels needs "
        f"{gemm_backward_weights_scratchpad_bytes(slab_geometry(geometry, 1))} bytes of oneDNN scratchpad "
        f"even for one output plane (limit {limit}): split it in height or width instead"
    )


def chunk_copy_bytes(geometry: ConvGeometry, batch: int) -> int:
    """Bytes a chunked filter gradient holds beside the layer's own tensors while one chunk runs (the
    chunks run one after another): the input slab and the zero-padded output-gradient slab, for the whole
    batch. 0 when the convolution is not chunked, or cannot be (``kernel_check`` warns about that layer).
    The study's tile (``up0_conv1``, 240x240x144, 32 -> 16 channels, two chunks of 120 planes): 0.75 GiB
    at batch 1."""
    try:
        chunk = plan_depth_chunk(geometry)
    except ValueError:
        return 0
    if chunk is None:
        return 0
    slab = slab_geometry(geometry, chunk)
    inputs = math.prod(slab.spatial) * slab.in_channels
    output_gradient = math.prod(slab.output_spatial) * slab.out_channels
    return batch * (inputs + output_gradient) * geometry.dtype_bytes


def filter_gradient_runs_gemm(cpu_flags: list[str] | frozenset[str] | None = None) -> bool:
    """Whether oneDNN runs a channels-last 3x3x3 Conv3D's filter gradient on its gemm kernel, the one with
    the scratchpad limit, on this CPU (or one with ``cpu_flags``): on CPUs without AVX-512, or when
    ``ONEDNN_MAX_CPU_ISA`` caps oneDNN below it. With AVX-512 it runs ``jit:avx512_core``, which has no such
    limit (6 MiB of scratchpad for the study's up0_conv1 whole), so chunking there would only cost the
    slab copies: the study's tile peaked at 10.64 GiB chunked and 9.98-10.05 GiB whole, at the same step time."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap and cap not in {"ALL", "DEFAULT"} and not cap.startswith(("AVX512", "AVX10")):
        return True
    flags = this_cpu_flags() if cpu_flags is None else frozenset(cpu_flags)
    return not AVX512_CORE_FLAGS <= flags
