"""One case as the network's input, numpy only: channel selection, crop or pad, per-channel z-score over
the brain, flips, binary or class labels. The one code path for training, validation and prediction."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bigmem_train.config import Config
from bigmem_train.data.reader import _READ_ERRORS, Case, _leading_index, _load_header, _placement
from bigmem_train.errors import BadInput


def channel_selection(config: Config, channels: int) -> list[int]:
    return list(range(channels)) if config.data.channels == "all" else list(config.data.channels)


def read_image(
    path: Path,
    selection: list[int],
    source_slices: tuple[slice, ...] | None = None,
    output_slices: tuple[slice, ...] | None = None,
    output_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """The channels ``selection`` of the image at ``path`` as (X, Y, Z, C) float32, ``scl_slope`` applied.

    ``source_slices`` read a region (a crop) and place it at ``output_slices`` of a zero volume of
    ``output_shape`` (a pad); all None reads the whole volume as it is. Raises :class:`BadInput` naming
    the file when it cannot be read, holds NaN or infinite values, or has too few channels.
    """
    image_file = _load_header(path)
    region = source_slices if source_slices is not None else tuple(slice(None) for _ in range(3))
    wanted = list(selection)
    try:
        if len(image_file.shape) == 3:
            volume = np.asanyarray(image_file.dataobj[region])[..., None]
            available, selection = 1, wanted
        else:
            available = image_file.shape[-1]
            if max(wanted) >= available:
                raise BadInput(f"{path}: has too few channels ({available}) for data.channels {wanted}")
            # One read covering the wanted channels: a .nii.gz decompresses only up to the last of them.
            first, last = min(wanted), max(wanted)
            volume = np.asanyarray(
                image_file.dataobj[(*region, *_leading_index(image_file), slice(first, last + 1))]
            )
            selection = [index - first for index in wanted]
    except _READ_ERRORS as error:
        raise BadInput(f"{path}: cannot be read ({error})") from None
    if volume.dtype.kind == "f" and not np.isfinite(volume).all():
        raise BadInput(f"{path}: holds NaN or infinite values; replace them (e.g. with 0) before training")
    if volume.shape[-1] <= max(selection):
        raise BadInput(f"{path}: has too few channels ({available}) for data.channels {wanted}")
    if output_shape is None:
        return np.ascontiguousarray(volume[..., selection], dtype=np.float32)
    image = np.zeros((*output_shape, len(selection)), dtype=np.float32)
    image[output_slices] = volume[..., selection]
    return image


def prepare_image(path: Path, config: Config, channels: int) -> np.ndarray:
    """A whole image as the network reads it at prediction: the configured channels of an image with
    ``channels`` channels, normalized as in training, at the image's own shape (X, Y, Z, C)."""
    image = read_image(path, channel_selection(config, channels))
    normalize_image(image)
    return image


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
    selection = channel_selection(config, case.channels)

    image = read_image(case.image, selection, source_slices, output_slices, target)
    if normalize:
        normalize_image(image)

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


def normalize_image(image: np.ndarray) -> None:
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
