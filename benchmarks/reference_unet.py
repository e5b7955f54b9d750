"""The reference: the study's 3D U-Net written the way a user would, in plain Keras on stock TensorFlow.

Self-contained on purpose (no bigmem_train import): no thread, allocator, precision or compiler
settings; numpy arrays in memory fed straight to ``model.fit``. Architecture and loss are the study's
(Ojika et al. 2020): per level (Conv3D 3x3x3 -> BatchNorm -> ReLU) x 2, MaxPool 2x2x2 down,
Conv3DTranspose 2x2x2 up, concatenated with the skip, 1x1x1 sigmoid out; Adam, 0.7 * -log(Dice) + 0.3 * BCE.
"""

from __future__ import annotations

import numpy as np


def conv_block(x, filters, name):
    from tensorflow import keras

    for index in (1, 2):
        x = keras.layers.Conv3D(filters, 3, padding="same", name=f"{name}_conv{index}")(x)
        x = keras.layers.BatchNormalization(name=f"{name}_bn{index}")(x)
        x = keras.layers.Activation("relu", name=f"{name}_relu{index}")(x)
    return x


def unet3d(input_shape, channels=1, base_filters=16, depth=4):
    from tensorflow import keras

    inputs = keras.Input((*input_shape, channels))
    x, skips = inputs, []
    for level in range(depth):
        x = conv_block(x, base_filters * 2**level, f"down{level}")
        skips.append(x)
        x = keras.layers.MaxPooling3D(2)(x)
    x = conv_block(x, base_filters * 2**depth, "bottom")
    for level in reversed(range(depth)):
        x = keras.layers.Conv3DTranspose(base_filters * 2**level, 2, strides=2, padding="same")(x)
        x = keras.layers.Concatenate()([x, skips[level]])
        x = conv_block(x, base_filters * 2**level, f"up{level}")
    outputs = keras.layers.Conv3D(1, 1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs)


def dice_coef(y_true, y_pred, smooth=1.0):
    import tensorflow as tf

    intersection = tf.reduce_sum(y_true * y_pred)
    return (2.0 * intersection + smooth) / (tf.reduce_sum(y_true) + tf.reduce_sum(y_pred) + smooth)


def dice_bce_loss(y_true, y_pred):
    import tensorflow as tf

    bce = tf.reduce_mean(tf.keras.losses.binary_crossentropy(y_true, y_pred))
    return 0.7 * -tf.math.log(dice_coef(y_true, y_pred)) + 0.3 * bce


def load_arrays(image_paths, label_paths, input_shape):
    """Read NIfTI volumes into numpy (first channel, centre crop, z-score) as a user script would."""
    import nibabel as nib

    images, labels = [], []
    for image_path, label_path in zip(image_paths, label_paths):
        image = np.asarray(nib.load(image_path).dataobj, dtype=np.float32)
        if image.ndim == 4:
            image = image[..., 0]
        label = (np.asarray(nib.load(label_path).dataobj) > 0).astype(np.float32)
        starts = [(edge - size) // 2 for edge, size in zip(image.shape, input_shape)]
        crop = tuple(slice(start, start + size) for start, size in zip(starts, input_shape))
        image, label = image[crop], label[crop]
        image = (image - image.mean()) / (image.std() + 1e-6)
        images.append(image[..., None])
        labels.append(label[..., None])
    return np.stack(images), np.stack(labels)
