"""The study's 3D U-Net (Ojika et al. 2020, after Cicek et al. 2016), its loss and Dice metrics.

Per level: (Conv3D 3x3x3 -> BatchNorm -> ReLU) x 2; MaxPool3D 2x2x2 down; Conv3DTranspose 2x2x2
stride 2 up, concatenated with the skip; a 1x1x1 Conv3D with sigmoid (one class) or softmax out.
With ``model.fold_upsampling`` the two shallowest decoder levels' transposed convolution, concatenation and
first convolution are one ``upconv.FoldedUpConv`` (same mathematics).
"""

from __future__ import annotations

import os

import keras
from keras import layers, ops

from bigmem_train.config import Config, ModelConfig
from bigmem_train.model.conv import ChunkedConv3D, conv3d_for
from bigmem_train.model.norm import FusedBatchNormalization
from bigmem_train.model.upconv import FoldedUpConv, folds_level

# For benchmarks only (benchmarks/throughput.py's lever): "keras" builds Keras' own unfused batch normalization,
# as a plain Keras script has, to measure the fused layer on its own.
BATCH_NORM_ENVIRONMENT = "BIGMEM_BATCH_NORM"


def batch_norm_layer(**kwargs) -> layers.BatchNormalization:
    """The kit's batch normalization (the fused kernel, norm.py), or Keras' own under BATCH_NORM_ENVIRONMENT."""
    if os.environ.get(BATCH_NORM_ENVIRONMENT) == "keras":
        return layers.BatchNormalization(**kwargs)
    return FusedBatchNormalization(**kwargs)


def _conv_block(x, filters: int, batch_norm: bool, name: str, synchronized: bool = False, first: int = 1):
    """(Conv3D -> BatchNorm -> ReLU) x 2; ``first`` = 2: ``x`` is already the first convolution's output."""
    for index in (1, 2):
        # Past oneDNN's gemm scratchpad limit a ChunkedConv3D (same mathematics) keeps the filter gradient off
        # the reference kernel (conv.py); below it the plain Keras layer.
        if index >= first:
            x = conv3d_for(
                x.shape, filters, 3, padding="same", use_bias=not batch_norm, name=f"{name}_conv{index}"
            )(x)
        if batch_norm:
            # Momentum 0.9 rather than Keras' 0.99: with batches of 1-16 volumes and runs of tens to
            # hundreds of steps, the moving statistics used for validation must catch up quickly.
            x = batch_norm_layer(momentum=0.9, synchronized=synchronized, name=f"{name}_bn{index}")(x)
        x = layers.Activation("relu", name=f"{name}_relu{index}")(x)
    return x


@keras.saving.register_keras_serializable(package="bigmem_train")
class RecomputedBlock(layers.Layer):
    """One U-Net block whose inner activations are recomputed during backward instead of kept.

    The block is what the planner calls a block (``planner._block_of``): ``downN``/``bottom`` = the conv
    block; ``upN`` = upsampling, concatenation with the skip, conv block. Only the block's inputs and
    its output cross into the backward pass; the conv, batch-norm and ReLU outputs inside are rebuilt
    from the inputs by ``tf.recompute_grad`` when the gradient reaches the block, one block at a time.
    The inner layers keep the names of the plain model (``down0_conv1``, ``up0_transpose``...).
    Cost: one extra forward pass of every block (batch-norm moving averages are updated twice per step).
    """

    def __init__(
        self,
        filters: int,
        batch_norm: bool = True,
        synchronized: bool = False,
        upsampling: str | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.filters = filters
        self.batch_norm = batch_norm
        self.synchronized = synchronized
        self.upsampling = upsampling
        self.upsample = None
        if upsampling == "transpose":
            self.upsample = layers.Conv3DTranspose(
                filters, 2, strides=2, padding="same", name=f"{self.name}_transpose"
            )
        elif upsampling == "resize":
            self.upsample = layers.UpSampling3D(2, name=f"{self.name}_resize")
        self.concat = layers.Concatenate(axis=-1, name=f"{self.name}_concat") if upsampling else None
        self.convs, self.norms = [], []
        for index in (1, 2):
            # The input shape is not known yet: ChunkedConv3D chunks only where it must (below oneDNN's
            # limit it runs the plain layer's ops).
            self.convs.append(
                ChunkedConv3D(
                    filters, 3, padding="same", use_bias=not batch_norm, name=f"{self.name}_conv{index}"
                )
            )
            if batch_norm:
                self.norms.append(
                    batch_norm_layer(momentum=0.9, synchronized=synchronized, name=f"{self.name}_bn{index}")
                )

    def build(self, input_shape):
        # Build every inner layer here so no variable is created inside the recomputed function.
        if self.upsample is not None:
            x_shape, skip_shape = input_shape
            self.upsample.build(x_shape)
            up_shape = self.upsample.compute_output_shape(x_shape)
            shape = (*up_shape[:-1], up_shape[-1] + skip_shape[-1])
        else:
            shape = input_shape
        for index, conv in enumerate(self.convs):
            conv.build(shape)
            shape = (*shape[:-1], self.filters)
            if self.batch_norm:
                self.norms[index].build(shape)

    def _forward(self, inputs, training):
        if self.upsample is not None:
            x, skip = inputs
            x = self.concat([self.upsample(x), skip])
        else:
            (x,) = inputs
        for index, conv in enumerate(self.convs):
            x = conv(x)
            if self.batch_norm:
                x = self.norms[index](x, training=training)
            x = ops.relu(x)
        return x

    def call(self, inputs, training=None):
        import tensorflow as tf

        inputs = list(inputs) if self.upsample is not None else [inputs]
        # A fixed Python bool: the recomputation runs outside Keras' call context.
        training = bool(training)
        return tf.recompute_grad(lambda *tensors: self._forward(tensors, training))(*inputs)

    def compute_output_shape(self, input_shape):
        if self.upsample is not None:
            x_shape = input_shape[0]
            return (x_shape[0], *(None if edge is None else edge * 2 for edge in x_shape[1:4]), self.filters)
        return (*input_shape[:-1], self.filters)

    def get_config(self):
        return {
            **super().get_config(),
            "filters": self.filters,
            "batch_norm": self.batch_norm,
            "synchronized": self.synchronized,
            "upsampling": self.upsampling,
        }


def build_unet(
    model_config: ModelConfig,
    input_shape: tuple[int, int, int],
    channels: int,
    synchronized_batch_norm: bool = False,
) -> keras.Model:
    """Build the 3D U-Net for volumes of ``input_shape`` (X, Y, Z) with ``channels`` channels last.

    ``synchronized_batch_norm``: batch statistics over the global batch of all workers (multi-worker
    training), so every worker normalises alike and keeps the same moving averages.
    ``model_config.recompute``: each block is one :class:`RecomputedBlock` layer (same inner layer
    names and weights, nested one level down) whose activations are recomputed during backward.
    """
    recompute = model_config.recompute
    batch_norm = model_config.batch_norm
    inputs = keras.Input(shape=(*input_shape, channels), name="volume")
    x = inputs
    skips = []
    for level in range(model_config.depth):
        filters = model_config.base_filters * 2**level
        if recompute:
            x = RecomputedBlock(filters, batch_norm, synchronized_batch_norm, name=f"down{level}")(x)
        else:
            x = _conv_block(x, filters, batch_norm, f"down{level}", synchronized_batch_norm)
        skips.append(x)
        x = layers.MaxPooling3D(2, name=f"pool{level}")(x)
    filters = model_config.base_filters * 2**model_config.depth
    if recompute:
        x = RecomputedBlock(filters, batch_norm, synchronized_batch_norm, name="bottom")(x)
    else:
        x = _conv_block(x, filters, batch_norm, "bottom", synchronized_batch_norm)
    for level in reversed(range(model_config.depth)):
        filters = model_config.base_filters * 2**level
        if recompute:
            x = RecomputedBlock(
                filters,
                batch_norm,
                synchronized_batch_norm,
                upsampling=model_config.upsampling,
                name=f"up{level}",
            )([x, skips[level]])
            continue
        if folds_level(level, model_config.fold_upsampling, model_config.upsampling, recompute):
            # Transposed convolution, concatenation and first convolution as one (upconv.py).
            x = FoldedUpConv(filters, use_bias=not batch_norm, name=f"up{level}_conv1")([x, skips[level]])
            x = _conv_block(x, filters, batch_norm, f"up{level}", synchronized_batch_norm, first=2)
            continue
        if model_config.upsampling == "transpose":
            x = layers.Conv3DTranspose(filters, 2, strides=2, padding="same", name=f"up{level}_transpose")(x)
        else:
            x = layers.UpSampling3D(2, name=f"up{level}_resize")(x)
        x = layers.Concatenate(axis=-1, name=f"up{level}_concat")([x, skips[level]])
        x = _conv_block(x, filters, batch_norm, f"up{level}", synchronized_batch_norm)
    activation = "sigmoid" if model_config.output_classes == 1 else "softmax"
    # The output stays float32 under mixed precision so the loss is computed in full precision.
    # Tumour is a few percent of a brain volume: start the sigmoid at that prior (bias -3 ~ 5 %) rather
    # than at 0.5 everywhere, so Dice rises within the first epochs instead of after the net unlearns
    # the background (the prior-probability initialisation of Lin et al., 2017).
    bias = keras.initializers.Constant(-3.0) if model_config.output_classes == 1 else "zeros"
    outputs = layers.Conv3D(
        model_config.output_classes,
        1,
        activation=activation,
        bias_initializer=bias,
        dtype="float32",
        name="segmentation",
    )(x)
    return keras.Model(inputs, outputs, name="unet3d")


def _one_hot_if_needed(y_true, y_pred):
    classes = y_pred.shape[-1]
    if classes > 1 and y_true.shape[-1] == 1:
        y_true = ops.one_hot(ops.cast(ops.squeeze(y_true, -1), "int32"), classes)
    return ops.cast(y_true, y_pred.dtype)


def soft_dice(y_true, y_pred, smooth: float = 1.0):
    """Soft Dice over the batch, averaged over foreground classes (class 0 is background when softmax)."""
    y_true = _one_hot_if_needed(y_true, y_pred)
    if y_pred.shape[-1] > 1:
        y_true, y_pred = y_true[..., 1:], y_pred[..., 1:]
    axes = tuple(range(len(y_pred.shape) - 1))
    intersection = ops.sum(y_true * y_pred, axis=axes)
    total = ops.sum(y_true, axis=axes) + ops.sum(y_pred, axis=axes)
    return ops.mean((2.0 * intersection + smooth) / (total + smooth))


def make_loss(dice_weight: float = 0.7):
    """The study's loss: dice_weight * -log(soft Dice) + (1 - dice_weight) * cross-entropy."""

    def dice_bce_loss(y_true, y_pred):
        y_true_prepared = _one_hot_if_needed(y_true, y_pred)
        epsilon = 1e-7
        clipped = ops.clip(y_pred, epsilon, 1.0 - epsilon)
        if y_pred.shape[-1] == 1:
            cross_entropy = -ops.mean(
                y_true_prepared * ops.log(clipped) + (1.0 - y_true_prepared) * ops.log(1.0 - clipped)
            )
        else:
            cross_entropy = -ops.mean(ops.sum(y_true_prepared * ops.log(clipped), axis=-1))
        return dice_weight * -ops.log(soft_dice(y_true, y_pred)) + (1.0 - dice_weight) * cross_entropy

    return dice_bce_loss


@keras.saving.register_keras_serializable(package="bigmem_train")
class HardDice(keras.metrics.Metric):
    """Dice of the thresholded (sigmoid > 0.5) or arg-maxed (softmax) prediction over every voxel since
    the last reset (the epoch, or the validation pass), averaged over foreground classes.

    Intersections and totals are summed over the batches and divided once, not averaged batch by batch:
    a batch whose label is all background scores Dice 1.0 for predicting nothing, and averaging such
    batches in would lift a model that finds no tumour towards a passing validation score. Summed
    across replicas in a multi-worker job.
    """

    def __init__(self, classes: int = 1, name: str = "hard_dice", **kwargs):
        super().__init__(name=name, **kwargs)
        self.classes = classes
        foreground = 1 if classes == 1 else classes - 1
        self.intersection = self.add_variable(
            shape=(foreground,), initializer="zeros", name="intersection", aggregation="sum"
        )
        self.total = self.add_variable(
            shape=(foreground,), initializer="zeros", name="total", aggregation="sum"
        )

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.cast(y_pred, "float32")
        if y_pred.shape[-1] == 1:
            prediction = ops.cast(y_pred > 0.5, "float32")
        else:
            prediction = ops.one_hot(ops.argmax(y_pred, axis=-1), y_pred.shape[-1])
        y_true = _one_hot_if_needed(y_true, prediction)
        if prediction.shape[-1] > 1:
            y_true, prediction = y_true[..., 1:], prediction[..., 1:]
        axes = tuple(range(len(prediction.shape) - 1))
        self.intersection.assign_add(ops.sum(y_true * prediction, axis=axes))
        self.total.assign_add(ops.sum(y_true, axis=axes) + ops.sum(prediction, axis=axes))

    def result(self):
        smooth = 1e-6
        return ops.mean((2.0 * self.intersection + smooth) / (self.total + smooth))

    def reset_state(self):
        for variable in (self.intersection, self.total):
            variable.assign(ops.zeros(variable.shape, variable.dtype))

    def get_config(self):
        return {**super().get_config(), "classes": self.classes}


def compile_model(config: Config) -> keras.Model:
    """Build and compile the configured U-Net (Adam, the study's loss, soft and hard Dice)."""
    if config.runtime.precision != "float32":
        keras.mixed_precision.set_global_policy(config.runtime.precision)
    model = build_unet(
        config.model,
        config.data.input_shape,
        config.num_channels,
        synchronized_batch_norm=config.synchronized_batch_norm,
    )
    model.compile(
        optimizer=keras.optimizers.Adam(config.training.learning_rate),
        loss=make_loss(config.training.dice_weight),
        metrics=[
            keras.metrics.MeanMetricWrapper(soft_dice, name="dice"),
            HardDice(config.model.output_classes),
        ],
        # XLA's CPU convolutions are Eigen's, not oneDNN's (docs/performance.md): never compiled with it.
        jit_compile=False,
    )
    if config.runtime.onednn:
        from bigmem_train.model.kernel_check import check_model, warn_reference_kernels

        # Free unless a convolution is past oneDNN's gemm limit; then one small probe of this CPU's kernels.
        warn_reference_kernels(check_model(model))
    return model
