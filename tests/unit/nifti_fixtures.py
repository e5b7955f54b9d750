"""Helpers that write tiny Decathlon-layout datasets for the reader's tests."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np

from bigmem_train.config import Config, config_from_dict


def save_nifti(data: np.ndarray, path: Path, slope: float | None = None, inter: float = 0.0) -> Path:
    """Write ``data`` as NIfTI (compressed when the name ends in .gz), optionally with scl_slope/inter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = nib.Nifti1Image(data, np.eye(4))
    if slope is not None:
        image.header.set_slope_inter(slope, inter)
    nib.save(image, path)
    return path


def write_dataset(folder: Path, cases: list[tuple[np.ndarray, np.ndarray]], **save_options) -> Path:
    """Write ``cases`` of (image, label) as imagesTr/labelsTr .nii.gz plus dataset.json; return the folder."""
    training = []
    for index, (image, label) in enumerate(cases, start=1):
        name = f"CASE_{index:03d}.nii.gz"
        save_nifti(image, folder / "imagesTr" / name, **save_options)
        save_nifti(label, folder / "labelsTr" / name)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    (folder / "dataset.json").write_text(json.dumps({"name": "test", "training": training, "test": []}))
    return folder


def phantom(shape=(16, 16, 12), channels: int | None = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A float32 image (4D, or 3D when channels is None) with zero background and a uint8 label 0..3."""
    rng = np.random.default_rng(seed)
    grid = np.indices(shape).astype(np.float32)
    centre = np.array(shape, dtype=np.float32)[:, None, None, None] / 2
    radius = np.sqrt((((grid - centre) / (np.array(shape)[:, None, None, None] * 0.4)) ** 2).sum(0))
    head = radius < 1
    label = np.zeros(shape, dtype=np.uint8)
    label[radius < 0.5] = 1
    label[radius < 0.35] = 3
    label[radius < 0.2] = 2
    planes = 1 if channels is None else channels
    image = np.zeros((*shape, planes), dtype=np.float32)
    for channel in range(planes):
        image[..., channel] = np.where(
            head, 100 + 50 * channel + 300 * (label > 0) + rng.normal(0, 5, shape), 0
        )
    return (image[..., 0] if channels is None else image), label


def small_config(path: Path | None = None, **data) -> Config:
    """A valid config with a depth-2 U-Net, so 16x16x12 inputs are allowed."""
    data_section = {
        "source": "decathlon",
        "path": str(path or "/nonexistent"),
        "input_shape": [16, 16, 12],
        "crop_jitter": 2,
        **data,
    }
    model = {"depth": 2, "base_filters": 2}
    if data_section.get("label_mode") == "multiclass":
        model["output_classes"] = 4
    return config_from_dict(
        {"data": data_section, "model": model, "training": {"batch_size": 2, "epochs": 1}}
    )
