"""A 3D convolution whose filter gradient stays on oneDNN's fast kernel at any volume.

The cliff (issue 14). On CPUs without AVX-512, oneDNN (v3.7, bundled with TensorFlow 2.21) has one fast
backward-weights kernel for TensorFlow's channels-last (NDHWC) data: ``x64:gemm:jit``
(``gemm_convolution_bwd_weights_t``). Its ``init_conf`` (src/cpu/gemm_convolution_utils.cpp, branch
``is_nspc && is_bwd_w``) books a scratchpad of

  * the im2col matrix of one output depth slice: ``in_channels x kernel volume x out H x out W``,
  * a transposed copy of one whole input sample: ``in_channels x D x H x W``
    (``key_conv_gemm_imtr``), and
  * a float weight-reduction buffer (``weights bytes`` floats),

each once per thread (one thread unless the slice is small and the batch has several samples), each
rounded up by 128 bytes, in the data type's size. When the total exceeds
``min(1 GiB, 15 x threads x (src + weights + dst bytes))`` the function returns ``unimplemented``
("scratchpad memory limit exceeded", gemm_convolution_utils.cpp:2146 in ``ONEDNN_VERBOSE=dispatch``) and
oneDNN falls back to ``ref:any``, a naive loop nest that is one to two orders of magnitude slower. The
study's first full-resolution decoder convolution (240x240x144, 32 -> 16 channels) books 1.18 GB.

The fix keeps the mathematics: the filter gradient is a sum over output positions, so it is computed
in depth chunks of the output gradient, each against the input slab its window reads (the halo planes
included), and the chunks are summed. Every chunk has the same slab shape (one oneDNN primitive, one
scratchpad) and the chunks run one after another, so only one slab copy is alive at a time. The
forward pass and the input gradient are TensorFlow's own ops (oneDNN's ``brg_conv_*`` kernels, which
have no such limit).
"""

from __future__ import annotations

import keras
from keras import layers

from bigmem_train.model.conv_geometry import (  # noqa: F401 (re-exported: the layer's geometry lives there)
    CHUNK_HEADROOM_BYTES,
    ONEDNN_BOOKING_ALIGNMENT,
    ONEDNN_SCRATCHPAD_LIMIT_BYTES,
    ConvGeometry,
    _halo,
    filter_gradient_runs_gemm,
    gemm_backward_weights_fits,
    gemm_backward_weights_limit,
    gemm_backward_weights_scratchpad_bytes,
    gemm_backward_weights_threads,
    plan_depth_chunk,
    slab_geometry,
)


def chunked_filter_gradient(inputs, output_gradient, kernel_shape, padding: str, chunk: int):
    """The filter gradient of a stride-1 3D convolution, summed over depth chunks of ``chunk`` output planes.

    Each chunk pairs a fixed-depth input slab (chunk + halo planes, clamped inside the volume) with the
    output gradient of its planes, zero-padded to the slab's positions, so the convolution's own padding
    is only ever used at the true borders of the volume; all chunks share one shape and one kernel.
    """
    import tensorflow as tf

    tf_padding = padding.upper()
    depth = inputs.shape[1]
    out_depth = output_gradient.shape[1]
    front, back = _halo(kernel_shape[0], padding)
    slab = min(depth, chunk + front + back)
    slab_out = slab if padding == "same" else slab - kernel_shape[0] + 1
    gradient = None
    for start in range(0, out_depth, chunk):
        stop = min(start + chunk, out_depth)
        low = min(max(start - front, 0), depth - slab)
        lead = start - low  # slab position of output plane `start`
        # One chunk at a time: its slab copy and kernel run after the previous chunk's sum.
        with tf.control_dependencies([] if gradient is None else [gradient]):
            x_slab = inputs[:, low : low + slab]
            dy_slab = tf.pad(
                output_gradient[:, start:stop],
                [[0, 0], [lead, slab_out - lead - (stop - start)], [0, 0], [0, 0], [0, 0]],
            )
            part = tf.raw_ops.Conv3DBackpropFilterV2(
                input=x_slab,
                filter_sizes=kernel_shape,
                out_backprop=dy_slab,
                strides=[1] * 5,
                padding=tf_padding,
            )
        gradient = part if gradient is None else gradient + part
    return gradient


def chunked_conv3d(inputs, kernel, padding: str, chunk: int | None):
    """``tf.nn.conv3d`` (stride 1, channels last) whose filter gradient is computed in depth chunks."""
    import tensorflow as tf

    tf_padding = padding.upper()
    if chunk is None:
        return tf.nn.conv3d(inputs, kernel, strides=[1] * 5, padding=tf_padding)
    kernel_shape = tuple(kernel.shape)
    # A tensor, not the variable: custom_gradient then owes the kernel's gradient as an input's.
    kernel = tf.convert_to_tensor(kernel)

    @tf.custom_gradient
    def convolve(x, w):
        def gradient(dy):
            dx = tf.raw_ops.Conv3DBackpropInputV2(
                input_sizes=tf.shape(x), filter=w, out_backprop=dy, strides=[1] * 5, padding=tf_padding
            )
            dw = chunked_filter_gradient(x, dy, kernel_shape, padding, chunk)
            return dx, dw

        return tf.nn.conv3d(x, w, strides=[1] * 5, padding=tf_padding), gradient

    return convolve(inputs, kernel)


def _depth_chunk(geometry: ConvGeometry, limit_bytes: int | None = None) -> int | None:
    """Output planes per filter-gradient chunk for ``geometry``, or None (unchunked): the one decision
    ``ChunkedConv3D`` and ``conv3d_for`` share. With oneDNN's own limit (``limit_bytes`` None) it chunks
    only where oneDNN runs the gemm filter gradient; a limit set by hand chunks on any CPU."""
    if limit_bytes is None and not filter_gradient_runs_gemm():
        return None  # oneDNN's filter gradient has no gemm scratchpad limit on this CPU
    return plan_depth_chunk(geometry, limit_bytes)


@keras.saving.register_keras_serializable(package="bigmem_train")
class ChunkedConv3D(layers.Conv3D):
    """``keras.layers.Conv3D`` (same weights, same outputs, same gradients) whose filter gradient is
    computed in depth chunks when the whole convolution would push oneDNN's gemm backward-weights kernel
    over its scratchpad limit and onto the reference kernel. Below the limit it runs exactly the plain
    layer's ops, and so it does on CPUs where oneDNN's filter gradient has no such limit (AVX-512:
    ``conv_geometry.filter_gradient_runs_gemm``), as ``conv3d_for`` builds plain layers there. Stride 1,
    no dilation, one group, channels last (what the U-Net uses).

    ``scratchpad_limit_bytes``: the bytes a chunk may book (default: oneDNN's 1 GiB less headroom, on CPUs
    that run the gemm kernel); tests set it to chunk small volumes on any CPU.
    """

    def __init__(self, *args, scratchpad_limit_bytes: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if (
            any(s != 1 for s in self.strides)
            or any(d != 1 for d in self.dilation_rate)
            or self.groups != 1
            or self.data_format != "channels_last"
        ):
            raise ValueError(
                f"{self.name}: ChunkedConv3D supports stride 1, dilation 1, one group and channels_last only"
            )
        self.scratchpad_limit_bytes = scratchpad_limit_bytes

    def geometry(self, input_shape) -> ConvGeometry:
        """This layer's convolution, per sample, at ``input_shape`` (batch, D, H, W, C)."""
        dtype_bytes = 2 if self.compute_dtype in ("bfloat16", "float16") else 4
        return ConvGeometry(
            tuple(int(edge) for edge in input_shape[1:4]),
            int(input_shape[-1]),
            self.filters,
            tuple(self.kernel_size),
            self.padding,
            dtype_bytes,
        )

    def depth_chunk(self, input_shape) -> int | None:
        """Output planes per filter-gradient chunk at ``input_shape``; None: unchunked."""
        if any(edge is None for edge in input_shape[1:]):
            return None
        return _depth_chunk(self.geometry(input_shape), self.scratchpad_limit_bytes)

    def convolution_op(self, inputs, kernel):
        chunk = self.depth_chunk(tuple(inputs.shape))
        if chunk is None:
            return super().convolution_op(inputs, kernel)
        return chunked_conv3d(inputs, kernel, self.padding, chunk)

    def get_config(self):
        return {**super().get_config(), "scratchpad_limit_bytes": self.scratchpad_limit_bytes}


def conv3d_for(input_shape, filters: int, kernel_size=3, padding: str = "same", **kwargs) -> layers.Conv3D:
    """A stride-1 Conv3D for inputs of ``input_shape`` (batch, D, H, W, C): ``ChunkedConv3D`` where the
    plain layer's filter gradient would fall off oneDNN's gemm kernel, else ``keras.layers.Conv3D``
    (so models below the limit are unchanged, layer classes included)."""
    if any(edge is None for edge in input_shape[1:]):
        return layers.Conv3D(filters, kernel_size, padding=padding, **kwargs)
    policy = keras.mixed_precision.global_policy()
    compute_dtype = kwargs.get("dtype") or policy.compute_dtype
    kernel = (kernel_size,) * 3 if isinstance(kernel_size, int) else tuple(kernel_size)
    geometry = ConvGeometry(
        tuple(int(edge) for edge in input_shape[1:4]),
        int(input_shape[-1]),
        filters,
        kernel,
        padding,
        2 if compute_dtype in ("bfloat16", "float16") else 4,
    )
    try:
        chunk = _depth_chunk(geometry)
    except ValueError:
        chunk = None  # not even one plane fits: kernel_check warns about this layer
    if chunk is None:
        return layers.Conv3D(filters, kernel_size, padding=padding, **kwargs)
    return ChunkedConv3D(filters, kernel_size, padding=padding, **kwargs)
