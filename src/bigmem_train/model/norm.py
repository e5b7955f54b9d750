"""Batch normalization computed by TensorFlow's fused kernel: Keras 3's layer, same mathematics, fewer passes.

Keras 3 normalizes with separate ops: ``tf.nn.moments`` (a mean, a squared difference and a second mean)
then ``tf.nn.batch_normalization`` (a multiply and an add), and its gradient is as many ops again, each a
pass over a full-size tensor. At the U-Net's full-resolution layers these passes are a large part of the
step that is not convolution (docs/design/performance.md). TensorFlow's ``FusedBatchNormV3`` computes the batch
moments and the normalized output in one kernel (oneDNN's batch normalization where TensorFlow's oneDNN
ops are on, channels-last 4-D and 5-D), and ``FusedBatchNormGradV3`` the three gradients in one more.

Same mathematics as :class:`keras.layers.BatchNormalization`: the output, the gradients and the moving
statistics agree to float32 round-off (``tests/unit/test_norm.py``). The kernel returns the Bessel-corrected
batch variance; Keras' moving variance is updated with the biased one, so the layer undoes the correction
before the update. Only the training pass of a plain channels-last layer is fused; everything else
(inference, ``synchronized`` batch statistics across workers, renorm, masks, a layer without ``center`` or
``scale``, an axis other than the last) is Keras' own code.
"""

from __future__ import annotations

import keras
from keras import layers, ops

# FusedBatchNormV3 rejects a smaller epsilon (TensorFlow's ``nn.fused_batch_norm`` raises it to this).
_MIN_FUSED_EPSILON = 1.001e-5


@keras.saving.register_keras_serializable(package="bigmem_train")
class FusedBatchNormalization(layers.BatchNormalization):
    """:class:`keras.layers.BatchNormalization` whose training pass runs TensorFlow's fused kernel."""

    def _fusable(self, inputs, mask) -> bool:
        rank = len(inputs.shape)
        return (
            keras.backend.backend() == "tensorflow"
            and rank in (4, 5)
            and self.axis in (-1, rank - 1)
            and mask is None
            and self.center
            and self.scale
            and not self.renorm
            and not self.synchronized
            and self.epsilon >= _MIN_FUSED_EPSILON
        )

    def call(self, inputs, training=None, mask=None):
        if not (training and self.trainable and self._fusable(inputs, mask)):
            return super().call(inputs, training=training, mask=mask)
        import tensorflow as tf

        # Keras computes batch normalization in float32 whatever the input (bfloat16 overflows): so does this.
        x = ops.cast(inputs, "float32")
        shape = tf.shape(x)
        if len(inputs.shape) == 5:
            # TensorFlow hands only 4-D batch normalization to oneDNN (its layout pass leaves 5-D to a slower
            # kernel). Per-channel statistics do not depend on how the other axes are grouped: fold D into H.
            x = tf.reshape(x, tf.stack([shape[0], shape[1] * shape[2], shape[3], shape[4]]))
        output, mean, corrected_variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x,
            scale=ops.cast(self.gamma, "float32"),
            offset=ops.cast(self.beta, "float32"),
            mean=tf.constant([], tf.float32),
            variance=tf.constant([], tf.float32),
            epsilon=self.epsilon,
            data_format="NHWC",
            is_training=True,
        )
        output = tf.reshape(output, shape)
        # Back to the biased (population) variance of the batch that Keras' moving average uses.
        count = ops.cast(ops.size(x) // ops.shape(x)[-1], "float32")
        variance = corrected_variance * (count - 1.0) / ops.maximum(count, 1.0)
        momentum = self.momentum
        self.moving_mean.assign(
            ops.cast(self.moving_mean, "float32") * momentum + ops.cast(mean, "float32") * (1.0 - momentum)
        )
        self.moving_variance.assign(
            ops.cast(self.moving_variance, "float32") * momentum + variance * (1.0 - momentum)
        )
        return ops.cast(output, self.compute_dtype)
