"""Masks out with their source's geometry, written so that an interrupted or failed write never looks
finished; a full filesystem is exit 3 with one line, any other failed write exit 2."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import nibabel as nib
import numpy as np

from bigmem_train.errors import BadInput, BigmemError, DoesNotFit

PARTIAL_PREFIX = ".partial-"
_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_error(path: Path, error: OSError) -> BigmemError:
    """What a failed write of ``path`` tells the user: a full filesystem (or quota) is DoesNotFit (exit 3),
    anything else (read-only, permissions, a folder in the way) BadInput (exit 2)."""
    if error.errno in _FULL:
        return DoesNotFit(
            f"the output filesystem is full: {path} could not be written ({error.strerror}); "
            f"free space there or give another --out"
        )
    return BadInput(f"{path}: cannot be written ({error.strerror or error})")


def check_out_dir(out_dir: Path, flag: str = "--out", create: bool = True) -> None:
    """Prove ``out_dir`` writable before any work, or BadInput naming it: created (``create``), or else
    its nearest existing folder probed, so a check that fails leaves nothing behind."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"{flag} {out_dir}: is a file, not a folder")
    folder = out_dir
    try:
        if create:
            out_dir.mkdir(parents=True, exist_ok=True)
        else:
            while not folder.exists():
                folder = folder.parent
            if not folder.is_dir():
                raise BadInput(f"{flag} {out_dir}: {folder} is a file, not a folder")
        probe = folder / f"{PARTIAL_PREFIX}write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise BadInput(f"{flag} {out_dir}: cannot be written ({error.strerror or error})") from None


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
    """Write to a hidden partial name in the same folder, then rename over ``path`` (one step on POSIX);
    a failed write leaves no partial file and raises :func:`write_error`'s error."""
    partial = path.with_name(PARTIAL_PREFIX + path.name)
    try:
        nib.save(image, partial)
        os.replace(partial, path)
    except OSError as error:
        raise write_error(path, error) from None
    finally:
        partial.unlink(missing_ok=True)
