"""The decoder's upsampling, concatenation and first convolution as one layer, with the same mathematics.

Each decoder level of the U-Net runs ``Conv3DTranspose(f, 2, strides=2)`` on the level below (``x``, 2f
channels), concatenates the result with the skip connection (f channels) and convolves the 2f channels with a
3x3x3 kernel ``K``. All three are linear, so the output is

    y = conv3d(skip, K[..., f:, :]) + conv3d(T(x), K[..., :f, :]),   T(x)[2i + q] = Wt[q] x[i] + b

and the second term is itself one transposed convolution of ``x``, stride 2, with a 4x4x4 kernel ``W4``: per
axis an output position 2i + p reads the inputs i - 1 and i (p = 0) or i and i + 1 (p = 1), and

    W4[k] = sum over q in {0, 1}, d in {-1, 0, 1} with k = q - d + 1 of  K_up[d] . Wt[q]

(the full convolution of the two kernels). The transposed convolution's bias rides on a channel of ones
appended to ``x``: a transposed convolution reads nothing outside the volume, so the bias reaches exactly the
full-resolution positions the 3x3x3 window of the original reads inside the volume, borders included.

Why: the upsampled half of the first decoder convolution is 27 taps at full resolution; folded it is 8
(64 taps at an eighth of the positions), and neither the upsampled tensor nor the concatenation is written.
Measured on a Xeon with AVX-512 (forward + both gradients, batch 1): 0.29 -> 0.22 s at the 96^3 job's full
resolution, 0.60 -> 0.42 s at 120^3. ``W4`` costs 216 small matrix products per step, which is more than it
saves where the volume is small against the channels (the deepest levels), so the model folds only its two
shallowest decoder levels (``FOLDED_LEVELS``), and only where ``fold_available``.

The layer's gradient runs its four large ops in a fixed order (the transposed convolution's input and filter
gradients, then the skip convolution's): TensorFlow's executor otherwise ran the two independent branches side
by side when it could, and which of their transients were alive together changed from run to run. Measured
on whole runs of 192x192x128, batch 2, 16 filters (3 December 2026, Xeon with AVX-512): peaks of 8.75-9.55
GiB in six runs with the branches free, 8.59-8.87 GiB in four runs ordered, at the same step time.

The weights are the unfolded layers' (``transpose_kernel`` (2, 2, 2, f, 2f), ``transpose_bias`` (f), ``kernel``
(3, 3, 3, f + skip channels, f)), initialised alike, so training follows the same mathematics; only
floating-point rounding differs (tests/unit/test_upconv.py compares outputs and every gradient).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers

# The decoder levels folded: the two shallowest (0 = full resolution). Deeper, W4's 216 products cost as much as
# the taps they save (forward + both gradients, batch 1: 12^3 x 64 filters 0.96x, 15^3 x 64 0.96x; 24^3 x 32
# 1.28x, 30^3 x 32 1.19x, 48^3 x 16 1.31x, 60^3 x 16 1.42x). Fixed levels rather than a volume rule keep the
# planner's layer table independent of the job's shape.
FOLDED_LEVELS = 2


def _tap_map() -> np.ndarray:
    """[64 taps of W4, 27 taps of K, 8 taps of Wt]: 1 where the pair contributes to the tap (k = q - d + 1)."""
    axis = np.zeros((4, 3, 2), np.float32)
    for q in (0, 1):
        for d in (-1, 0, 1):
            axis[q - d + 1, d + 1, q] = 1.0
    return np.einsum("adq,beu,cfv->abcdefquv", axis, axis, axis).reshape(64, 27, 8)


TAP_MAP = _tap_map()


def fold_available() -> bool:
    """Whether this CPU folds: only where oneDNN's filter gradient is its direct AVX-512 kernel. On AVX2 CPUs
    its gemm kernel has a scratchpad limit (conv.py) that the folded layer's convolutions are not chunked
    under, so the model keeps the unfolded layers there."""
    from bigmem_train.model import conv  # the one switch ChunkedConv3D's choice reads too

    return not conv.filter_gradient_runs_gemm()


def folds_level(level: int, fold_upsampling: bool, upsampling: str, recompute: bool) -> bool:
    """Whether decoder level ``level`` of a model so configured is one FoldedUpConv layer."""
    return (
        fold_upsampling
        and upsampling == "transpose"
        and not recompute
        and level < FOLDED_LEVELS
        and fold_available()
    )


def _folded_sum(with_ones, skip, folded_kernel, skip_kernel, output_shape):
    """``conv3d_transpose(with_ones, folded_kernel) + conv3d(skip, skip_kernel)``, with a gradient that runs
    its four large ops one after another (the transposed convolution's two, then the skip convolution's two)
    rather than letting the two branches run side by side: TensorFlow's executor may overlap independent
    ops, and which transients were alive together then varied from run to run."""
    import tensorflow as tf

    strides, unit = [1, 2, 2, 2, 1], [1, 1, 1, 1, 1]

    @tf.custom_gradient
    def forward(with_ones, skip, folded_kernel, skip_kernel):
        up = tf.nn.conv3d_transpose(with_ones, folded_kernel, output_shape, strides, "SAME")
        with tf.control_dependencies([up]):
            outputs = up + tf.nn.conv3d(skip, skip_kernel, unit, "SAME")

        def gradient(upstream):
            d_with_ones = tf.nn.conv3d(upstream, folded_kernel, strides, "SAME")
            with tf.control_dependencies([d_with_ones]):
                d_folded = tf.raw_ops.Conv3DBackpropFilterV2(
                    input=upstream,
                    filter_sizes=tf.shape(folded_kernel),
                    out_backprop=with_ones,
                    strides=strides,
                    padding="SAME",
                )
            with tf.control_dependencies([d_folded]):
                d_skip = tf.raw_ops.Conv3DBackpropInputV2(
                    input_sizes=tf.shape(skip),
                    filter=skip_kernel,
                    out_backprop=upstream,
                    strides=unit,
                    padding="SAME",
                )
            with tf.control_dependencies([d_skip]):
                d_skip_kernel = tf.raw_ops.Conv3DBackpropFilterV2(
                    input=skip,
                    filter_sizes=tf.shape(skip_kernel),
                    out_backprop=upstream,
                    strides=unit,
                    padding="SAME",
                )
            return d_with_ones, d_skip, d_folded, d_skip_kernel

        return outputs, gradient

    return forward(with_ones, skip, folded_kernel, skip_kernel)


@keras.saving.register_keras_serializable(package="bigmem_train")
class FoldedUpConv(layers.Layer):
    """``Conv3DTranspose(filters, 2, strides=2, padding="same")`` -> ``Concatenate([up, skip])`` ->
    ``Conv3D(filters, 3, padding="same", use_bias=use_bias)`` in one layer (module docstring).

    Called on ``[x, skip]``: ``x`` the level below (any channels), ``skip`` the encoder's output at twice
    ``x``'s edges. The output is the convolution's (before batch normalization).
    """

    def __init__(self, filters: int, use_bias: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.use_bias = use_bias

    def build(self, input_shape):
        x_shape, skip_shape = input_shape
        low, skip_channels = int(x_shape[-1]), int(skip_shape[-1])
        glorot = keras.initializers.GlorotUniform()
        # The shapes, names and initialisers of Conv3DTranspose's and Conv3D's own weights.
        self.transpose_kernel = self.add_weight(
            name="transpose_kernel", shape=(2, 2, 2, self.filters, low), initializer=glorot
        )
        self.transpose_bias = self.add_weight(
            name="transpose_bias", shape=(self.filters,), initializer="zeros"
        )
        self.kernel = self.add_weight(
            name="kernel", shape=(3, 3, 3, self.filters + skip_channels, self.filters), initializer=glorot
        )
        self.bias = (
            self.add_weight(name="bias", shape=(self.filters,), initializer="zeros")
            if self.use_bias
            else None
        )

    def folded_kernel(self):
        """W4 (4, 4, 4, filters, input channels + 1): the transposed convolution of ``[x, ones]`` that equals
        the convolution of the upsampled half, transposed bias included (in the variables' dtype)."""
        import tensorflow as tf

        f = self.filters
        kernel = tf.convert_to_tensor(self.kernel.value)
        transpose = tf.convert_to_tensor(self.transpose_kernel.value)
        bias = tf.reshape(tf.convert_to_tensor(self.transpose_bias.value), [1, 1, 1, f, 1])
        transpose = tf.concat([transpose, tf.broadcast_to(bias, [2, 2, 2, f, 1])], axis=-1)
        inputs = transpose.shape[-1]
        up_half = tf.reshape(kernel[:, :, :, :f, :], [27, f, f])  # d, m, o
        pairs = tf.einsum("qmi,dmo->dqoi", tf.reshape(transpose, [8, f, inputs]), up_half)
        folded = tf.einsum("kdq,dqoi->koi", tf.constant(TAP_MAP, dtype=pairs.dtype), pairs)
        return tf.reshape(folded, [4, 4, 4, f, inputs])

    def call(self, inputs):
        import tensorflow as tf

        x, skip = inputs
        dtype = self.compute_dtype
        x = tf.cast(x, dtype)
        skip = tf.cast(skip, dtype)
        with_ones = tf.concat([x, tf.ones_like(x[..., :1])], axis=-1)
        spatial = [2 * int(edge) if edge is not None else None for edge in x.shape[1:4]]
        if None in spatial:
            spatial = tf.unstack(2 * tf.shape(x)[1:4])
        output_shape = tf.stack([tf.shape(x)[0], *spatial, self.filters])
        skip_kernel = tf.cast(tf.convert_to_tensor(self.kernel.value)[:, :, :, self.filters :, :], dtype)
        outputs = _folded_sum(
            with_ones, skip, tf.cast(self.folded_kernel(), dtype), skip_kernel, output_shape
        )
        if self.bias is not None:
            outputs = tf.nn.bias_add(outputs, tf.cast(self.bias.value, dtype))
        return outputs

    def compute_output_shape(self, input_shape):
        x_shape = input_shape[0]
        return (x_shape[0], *(None if edge is None else 2 * edge for edge in x_shape[1:4]), self.filters)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "use_bias": self.use_bias}
