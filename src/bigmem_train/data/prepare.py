"""One case as the network's input, numpy only: channel selection, crop or pad, per-channel z-score over
the brain, flips, binary or class labels. The one code path for training, validation and prediction."""

from __future__ import annotations

import numpy as np

from bigmem_train.config import Config
from bigmem_train.data.reader import _READ_ERRORS, Case, _leading_index, _load_header, _placement
from bigmem_train.errors import BadInput


def _channel_selection(config: Config, channels: int) -> list[int]:
    return list(range(channels)) if config.data.channels == "all" else list(config.data.channels)


def prepare_case(
    case: Case, config: Config, rng: np.random.Generator | None = None, normalize: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Load one case as ((X, Y, Z, C) float32 image, (X, Y, Z, 1) float32 label) at ``data.input_shape``.

    ``rng`` given (training): the crop is shifted by up to ``data.crop_jitter`` voxels per axis and,
    with ``data.augment_flips``, flipped along each axis with probability 1/2. ``rng`` None
    (validation): the exact centre, no flips. Labels are 0/1 (binary) or class indices (multiclass).
    ``normalize`` False skips the z-score (the scaled values as stored, for tests and inspection).
    """
    target = config.data.input_shape
    placements = [
        _placement(source, edge, config.data.crop_jitter, rng) for source, edge in zip(case.shape, target)
    ]
    source_slices = tuple(slice(start, start + length) for start, _, length in placements)
    output_slices = tuple(slice(start, start + length) for _, start, length in placements)
    selection = _channel_selection(config, case.channels)

    image_file = _load_header(case.image)
    try:
        if len(image_file.shape) == 3:
            volume = np.asanyarray(image_file.dataobj[source_slices])[..., None]
        else:
            # One read covering the wanted channels: a .nii.gz decompresses only up to the last of them.
            first, last = min(selection), max(selection)
            volume = np.asanyarray(
                image_file.dataobj[(*source_slices, *_leading_index(image_file), slice(first, last + 1))]
            )
            selection = [index - first for index in selection]
    except _READ_ERRORS as error:
        raise BadInput(f"{case.image}: cannot be read ({error})") from None
    if volume.dtype.kind == "f" and not np.isfinite(volume).all():
        raise BadInput(
            f"{case.image}: holds NaN or infinite values; replace them (e.g. with 0) before training"
        )
    if volume.shape[-1] <= max(selection):
        raise BadInput(f"{case.image}: has too few channels for data.channels {config.data.channels}")
    image = np.zeros((*target, len(selection)), dtype=np.float32)
    image[output_slices] = volume[..., selection]
    del volume
    if normalize:
        _zscore_brain(image)

    label_file = _load_header(case.label)
    try:
        label_slices = (*source_slices, *([0] * (len(label_file.shape) - 3)))
        values = np.asanyarray(label_file.dataobj[label_slices])
        if not np.issubdtype(values.dtype, np.integer):
            values = np.rint(values)
    except _READ_ERRORS as error:
        raise BadInput(f"{case.label}: cannot be read ({error})") from None
    if values.shape != tuple(length for _, _, length in placements):
        raise BadInput(
            f"{case.label}: label shape {list(label_file.shape)} differs from the image's {list(case.shape)}"
        )
    label = np.zeros((*target, 1), dtype=np.float32)
    if config.data.label_mode == "binary":
        label[(*output_slices, 0)] = values > 0
    else:
        if values.size and (values.min() < 0 or values.max() >= config.model.output_classes):
            raise BadInput(
                f"{case.label}: label values {int(values.min())}..{int(values.max())} are not classes "
                f"0..{config.model.output_classes - 1}"
            )
        label[(*output_slices, 0)] = values

    if rng is not None and config.data.augment_flips:
        for axis in range(3):
            if rng.random() < 0.5:
                image, label = np.flip(image, axis), np.flip(label, axis)
        image, label = np.ascontiguousarray(image), np.ascontiguousarray(label)
    return image, label


def _zscore_brain(image: np.ndarray) -> None:
    """In place, per channel: z-score over the brain (nonzero voxels); the background stays 0."""
    for channel in range(image.shape[-1]):
        values = image[..., channel]
        brain = values != 0
        if not brain.any():
            continue
        inside = values[brain]
        mean = float(inside.mean(dtype=np.float64))
        std = float(inside.std(dtype=np.float64))
        # In place: a full-size volume makes every temporary tens of megabytes.
        inside -= np.float32(mean)
        inside /= np.float32(std if std > 1e-6 else 1.0)
        values[brain] = inside
