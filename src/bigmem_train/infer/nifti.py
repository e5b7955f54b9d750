"""Masks out with their source's geometry, written so that an interrupted write never looks finished."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np

PARTIAL_PREFIX = ".partial-"


def output_path(out_dir: Path, name: str, suffix: str = "") -> Path:
    return out_dir / f"{name}{suffix}.nii.gz"


def like_source(source: nib.Nifti1Image, data: np.ndarray, dtype: type) -> nib.Nifti1Image:
    """``data`` (3D, or 3D + classes) as an image of the source's class with its affine, qform and sform
    (and their codes), voxel sizes and orientation; no intensity scaling."""
    header = source.header.copy()
    image = type(source)(np.asarray(data, dtype=dtype), source.affine, header=header)
    image.set_data_dtype(dtype)
    qform, qform_code = source.get_qform(coded=True)
    sform, sform_code = source.get_sform(coded=True)
    image.set_qform(qform if qform is not None else source.affine, int(qform_code or 0))
    image.set_sform(sform if sform is not None else source.affine, int(sform_code or 0))
    zooms = source.header.get_zooms()[:3]
    image.header.set_zooms(zooms + image.header.get_zooms()[3:])
    image.header.set_slope_inter(1.0, 0.0)
    image.header["intent_code"] = 0
    return image


def write_atomically(image: nib.Nifti1Image, path: Path) -> None:
    """Write to a hidden partial name in the same folder, then rename over ``path`` (one step on POSIX)."""
    partial = path.with_name(PARTIAL_PREFIX + path.name)
    try:
        nib.save(image, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
