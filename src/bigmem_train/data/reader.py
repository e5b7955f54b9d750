"""Decathlon reader: ``dataset.json`` and NIfTI volumes -> checked cases -> a ``tf.data`` pipeline.

Stages, each usable alone:

- :func:`read_index` parses ``dataset.json`` (the ``training`` list) and reads each image header;
- :func:`check_dataset` opens every image and label, checks shapes, channels, label values and that
  each file is complete (a ``.nii.gz`` is decompressed as a stream, never held), and fails with one
  line naming the file; it counts each label's foreground, in the whole volume and in the centre crop
  validation reads;
- :func:`split_cases` makes the seeded train/validation split (:func:`balance_split` evens it for
  several workers); :func:`check_foreground` refuses a split with nothing to learn or to score;
- :func:`prepare_case` turns one case into the network's input (numpy only: channel selection,
  crop or pad, per-channel z-score over the brain, flips, binary or class labels);
- :func:`make_datasets` wraps it in ``tf.data``: case indices -> shuffle -> parallel map -> batch ->
  prefetch. Only indices are shuffled, nothing is cached, so the pipeline holds at most the volumes in
  flight in the map plus the batches being built and prefetched.

TensorFlow is imported inside :func:`make_datasets` only.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import nibabel as nib
import numpy as np

from bigmem_train.config import Config
from bigmem_train.errors import BadInput

# Errors nibabel, gzip and zlib raise on a corrupt, truncated or unreadable file.
_READ_ERRORS = (OSError, EOFError, zlib.error, ValueError, nib.filebasedimages.ImageFileError)
# Decompression chunk for the completeness check: memory stays at this size whatever the volume.
_STREAM_CHUNK_BYTES = 4 << 20
# Deflate expands a byte to at most 1032 (its longest match per shortest code); rounded up.
_MAX_DEFLATE_RATIO = 1100
# Checking prints a progress line this often (seconds) while it runs.
_PROGRESS_SECONDS = 5.0


@dataclass(frozen=True)
class Case:
    """One training case: its image and label files and the image's spatial shape and channel count."""

    name: str
    image: Path
    label: Path
    shape: tuple[int, int, int]
    channels: int
    # Foreground voxels of the label (any value above 0), in the whole volume and in the centre crop
    # at data.input_shape that validation reads; None until check_dataset has read the label.
    foreground: int | None = None
    centre_foreground: int | None = None


# The file names the kit reads and writes as NIfTI volumes.
NIFTI_SUFFIXES = (".nii.gz", ".nii")


def _case_name(path: Path) -> str:
    name = path.name
    for suffix in NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _reason(error: BaseException) -> str:
    """A library's error as one line (nibabel's span several): the CLI prints each error as one."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _load_header(path: Path) -> nib.Nifti1Image:
    """Open a NIfTI file (header only; the data stays on disk behind ``dataobj``), refused when the file
    is too small for the data its header announces (:func:`_check_size`)."""
    try:
        image = nib.load(path)
    except _READ_ERRORS as error:
        raise BadInput(f"{path}: not a readable NIfTI file ({_reason(error)})") from None
    _check_size(path, image)
    return image


def _data_extent(image: nib.Nifti1Image) -> tuple[int, int]:
    """(offset of the data in the file, bytes of data) as the header announces them."""
    # The proxy's offset is where the data really starts (the header field may say 0 for a .nii).
    offset = int(getattr(image.dataobj, "offset", image.header.get_data_offset()))
    return offset, math.prod(int(edge) for edge in image.shape) * image.header.get_data_dtype().itemsize


def _check_size(path: Path, image: nib.Nifti1Image) -> None:
    """The cheap half of :func:`_check_complete`, from the file's size alone: a .nii must hold the data
    its header announces, a .nii.gz at most what deflate can expand it to. A header that claims far more
    than its file holds is a truncated (or damaged) file, not a volume to plan memory for."""
    offset, data_bytes = _data_extent(image)
    expected, size = offset + data_bytes, path.stat().st_size
    if path.name.endswith(".gz"):
        if size * _MAX_DEFLATE_RATIO < expected:
            raise BadInput(
                f"{path}: truncated: its header announces {data_bytes} bytes of data "
                f"({'x'.join(map(str, image.shape))}), more than a gzip file of {size} bytes can hold"
            )
    elif size < expected:
        raise BadInput(f"{path}: truncated: {size} bytes, the header needs {expected}")


def _geometry(path: Path, image: nib.Nifti1Image) -> tuple[tuple[int, int, int], int]:
    """The image's spatial shape and channel count: (X,Y,Z), (X,Y,Z,C) as the Decathlon writes it, or
    (X,Y,Z,1,C), the NIfTI standard's place for the components of one volume (dim 5, time 1)."""
    shape = tuple(int(edge) for edge in image.shape)
    if len(shape) == 3:
        spatial, channels = shape, 1
    elif len(shape) == 4:
        spatial, channels = shape[:3], shape[3]
    elif len(shape) == 5 and shape[3] == 1:
        spatial, channels = shape[:3], shape[4]
    else:
        raise BadInput(
            f"{path}: image is {len(shape)}D {list(shape)}; expected 3D (X,Y,Z), 4D (X,Y,Z,channels) "
            f"or 5D (X,Y,Z,1,channels)"
        )
    if min(shape) < 1:
        raise BadInput(f"{path}: image shape {list(shape)} has an empty axis")
    return spatial, channels


def _leading_index(image: nib.Nifti1Image) -> tuple[int, ...]:
    """Index of the singleton axes between the spatial ones and the channels (5D: the time axis)."""
    return (0,) if len(image.shape) == 5 else ()


def _orientation(image: nib.Nifti1Image) -> str | None:
    """The voxel axes' orientation (e.g. 'RAS'), or None when the header states none (both codes 0)."""
    header = image.header
    try:
        if int(header["sform_code"]) == 0 and int(header["qform_code"]) == 0:
            return None
        return "".join(nib.aff2axcodes(image.affine))
    except (KeyError, ValueError, TypeError):
        return None


def _placement(
    source: int, target: int, jitter: int, rng: np.random.Generator | None
) -> tuple[int, int, int]:
    """(start in the volume, start in the output, length) along one axis: centred, shifted by jitter.

    A volume longer than the target is cropped; a shorter one is padded (placed inside the output).
    """
    room = abs(source - target)
    start = room // 2
    if rng is not None and jitter:
        start = int(np.clip(start + rng.integers(-jitter, jitter + 1), 0, room))
    return (start, 0, target) if source >= target else (0, start, source)


def read_index(dataset_dir: Path) -> list[Case]:
    """Parse ``dataset.json``'s ``training`` list; check the files exist and read each image header."""
    dataset_dir = Path(dataset_dir)
    if dataset_dir.exists() and not dataset_dir.is_dir():
        raise BadInput(f"dataset folder {dataset_dir} is a file, not a folder")
    if not dataset_dir.is_dir():
        raise BadInput(f"dataset folder {dataset_dir} does not exist")
    index_path = dataset_dir / "dataset.json"
    if not index_path.is_file():
        raise BadInput(f"{index_path}: missing; a Decathlon dataset folder holds dataset.json")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as error:
        raise BadInput(f"{index_path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{index_path}: cannot be read ({error})") from None
    if not isinstance(index, dict) or not isinstance(index.get("training"), list):
        raise BadInput(f'{index_path}: no \'training\' list of {{"image": ..., "label": ...}} entries')
    if not index["training"]:
        raise BadInput(f"{index_path}: the 'training' list is empty")

    cases = []
    # Each file and case name once: a case listed twice can land in both the training and the validation
    # set, and the model is then scored on a volume it was fitted on.
    seen: dict[object, int] = {}
    for position, entry in enumerate(index["training"]):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("image"), str)
            and isinstance(entry.get("label"), str)
        ):
            raise BadInput(f"{index_path}: training[{position}] needs 'image' and 'label' paths")
        image_path, label_path = dataset_dir / entry["image"], dataset_dir / entry["label"]
        for path in (image_path, label_path):
            if not path.is_file():
                raise BadInput(f"{path}: missing (listed in {index_path} training[{position}])")
        name = _case_name(image_path)
        for what, key in (
            ("image", ("file", image_path.resolve())),
            ("label", ("file", label_path.resolve())),
            ("case name", ("name", name)),
        ):
            if key in seen:
                raise BadInput(
                    f"{index_path}: training[{position}] lists the {what} {key[1]} that training[{seen[key]}] "
                    "lists: a case in both the training and the validation set would be scored on data "
                    "it was fitted on"
                )
            seen[key] = position
        shape, channels = _geometry(image_path, _load_header(image_path))
        cases.append(Case(name, image_path, label_path, shape, channels))
    return cases


def _check_complete(path: Path, image: nib.Nifti1Image) -> None:
    """Raise unless the file holds all the data its header announces and, for floating-point data, no
    value is NaN or infinite. The file is streamed in chunks (a .nii.gz is decompressed, not held), so
    memory stays at one chunk whatever the volume; an integer .nii is only measured."""
    offset, data_bytes = _data_extent(image)
    dtype = image.header.get_data_dtype()
    expected = offset + data_bytes
    scan_values = dtype.kind == "f"
    compressed = path.name.endswith(".gz")
    if not compressed and not scan_values:
        total = path.stat().st_size
    else:
        total = nonfinite = 0
        carry = b""
        buffer = bytearray(_STREAM_CHUNK_BYTES)
        try:
            with gzip.open(path, "rb") if compressed else open(path, "rb") as stream:
                while read := stream.readinto(buffer):
                    if scan_values:
                        start, end = max(offset - total, 0), min(expected - total, read)
                        if start < end:
                            piece = carry + bytes(buffer[start:end])
                            whole = len(piece) - len(piece) % dtype.itemsize
                            values = np.frombuffer(piece, dtype=dtype, count=whole // dtype.itemsize)
                            nonfinite += values.size - int(np.count_nonzero(np.isfinite(values)))
                            carry = piece[whole:]
                    total += read
        except (EOFError, OSError, zlib.error) as error:
            raise BadInput(
                f"{path}: corrupt or truncated {'gzip stream' if compressed else 'file'} ({_reason(error)})"
            ) from None
        if total >= expected and nonfinite:
            raise BadInput(
                f"{path}: {nonfinite} of {data_bytes // dtype.itemsize} voxel values are NaN or infinite; "
                "replace them (e.g. with 0, the background) first"
            )
    if total < expected:
        raise BadInput(f"{path}: truncated: {total} bytes of data, the header needs {expected}")


def check_image_file(path: Path) -> nib.Nifti1Image:
    """The image at ``path`` (header loaded), once it is known readable, of a real number type, whole and
    finite: the file streamed to its end, so a .nii.gz's checksum is verified too (a damaged stream can
    decompress to wrong values without an error until then)."""
    image = _load_header(path)
    check_real_type(path, image)
    _check_complete(path, image)
    return image


def _check_case(case: Case, config: Config) -> Case:
    """Check one case's files against each other and the config; return it with its foreground counted."""
    image = _load_header(case.image)
    label = _load_header(case.label)
    check_real_type(case.image, image)
    label_shape = tuple(int(edge) for edge in label.shape)
    if len(label_shape) > 3 and all(edge == 1 for edge in label_shape[3:]):
        label_shape = label_shape[:3]
    if len(label_shape) != 3:
        raise BadInput(f"{case.label}: label is {len(label_shape)}D {list(label_shape)}; expected 3D (X,Y,Z)")
    if label_shape != case.shape:
        raise BadInput(
            f"{case.label}: label shape {list(label_shape)} differs from the image's spatial shape "
            f"{list(case.shape)} ({case.image})"
        )
    image_orientation, label_orientation = _orientation(image), _orientation(label)
    if image_orientation and label_orientation and image_orientation != label_orientation:
        raise BadInput(
            f"{case.label}: voxel axes are oriented {label_orientation} but the image's are "
            f"{image_orientation} ({case.image}); resample the label onto the image's grid"
        )
    check_channels(case.image, case.channels, config)
    _check_complete(case.image, image)
    _check_complete(case.label, label)
    try:
        values = np.asanyarray(label.dataobj)
    except _READ_ERRORS as error:
        raise BadInput(f"{case.label}: cannot be read ({_reason(error)})") from None
    _check_label_values(case.label, values, config)
    centre = tuple(
        slice(start, start + length)
        for start, _, length in (
            _placement(source, edge, 0, None) for source, edge in zip(case.shape, config.data.input_shape)
        )
    )
    foreground = values > 0
    return replace(
        case,
        foreground=int(np.count_nonzero(foreground)),
        centre_foreground=int(np.count_nonzero(foreground[centre])),
    )


def check_real_type(path: Path, image: nib.Nifti1Image) -> None:
    """An image's voxels must be real numbers (not complex, not RGB), from its header."""
    dtype = image.header.get_data_dtype()
    if not (np.issubdtype(dtype, np.number) and not np.issubdtype(dtype, np.complexfloating)):
        raise BadInput(f"{path}: image data type {dtype} is not a real number type")


def check_channels(path: Path, channels: int, config: Config) -> None:
    """An image of ``channels`` channels must hold the ones the model reads: the indices of
    ``data.channels``, or for "all" exactly the model's number of channels."""
    wanted = config.data.channels
    if wanted == "all":
        if channels != config.num_channels:
            raise BadInput(
                f"{path}: has {channels} channel(s), but the model's data.channels 'all' reads "
                f"{config.num_channels}; give images of {config.num_channels} channels (or list the channels)"
            )
    elif max(wanted) >= channels:
        raise BadInput(
            f"{path}: has {channels} channel(s), too few for the model's data.channels {wanted} "
            f"(the image's indices are 0..{channels - 1})"
        )


def check_class_values(path: Path, values: np.ndarray) -> None:
    """A label or a mask holds class indices: finite, non-negative integers (float storage allowed)."""
    if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
        raise BadInput(f"{path}: holds NaN or infinite values, not class indices")
    if values.size and values.min() < 0:
        raise BadInput(f"{path}: holds negative values ({values.min():g}), not class indices")
    if values.dtype.kind == "f":
        fractional = values[values != np.rint(values)]
        if fractional.size:
            raise BadInput(
                f"{path}: holds {fractional.size} non-integer value(s) (e.g. {fractional.flat[0]:g}), "
                f"not class indices; a label or mask holds 0, 1, 2, ..."
            )


def _check_label_values(path: Path, values: np.ndarray, config: Config) -> None:
    check_class_values(path, values)
    classes = config.model.output_classes
    if config.data.label_mode == "multiclass" and values.size and values.max() >= classes:
        raise BadInput(
            f"{path}: label value {int(values.max())} is not a class of model.output_classes = "
            f"{classes} (0..{classes - 1})"
        )


def check_dataset(config: Config, dataset_dir: Path | None = None) -> list[Case]:
    """Read the index and check every case; return the cases (foreground counted) or raise
    :class:`BadInput` naming a file.

    ``dataset_dir`` defaults to ``config.data.path``. Files are checked in a thread pool (zlib
    decompression runs outside the GIL); cases are returned in ``dataset.json`` order.
    """
    dataset_dir = dataset_dir if dataset_dir is not None else config.data.path
    if dataset_dir is None:
        raise BadInput("data.path is not set: name the dataset folder (the one holding dataset.json)")
    cases = read_index(Path(dataset_dir))
    workers = max(1, min(8, os.cpu_count() or 1, len(cases)))
    started = last_line = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="check-data") as pool:
        futures = [pool.submit(_check_case, case, config) for case in cases]
        checked = []
        for done, future in enumerate(futures, start=1):
            try:
                checked.append(future.result())
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            now = time.monotonic()
            # A line every few seconds while it takes long (full-size volumes), and the total at the end.
            if now - last_line >= _PROGRESS_SECONDS or (
                done == len(cases) and now - started >= _PROGRESS_SECONDS
            ):
                print(
                    f"checking dataset: {done}/{len(cases)} cases ({now - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                last_line = now
    return checked


def check_dataset_folder(config: Config) -> None:
    """The cheap checks on a Decathlon folder, before planning (the full check reads every file later)."""
    if config.data.source != "decathlon":
        return
    folder = Path(config.data.path)
    if folder.exists() and not folder.is_dir():
        raise BadInput(
            f"data.path {config.data.path} is a file, not a folder: name the Decathlon folder that holds "
            f"dataset.json"
        )
    if not folder.is_dir():
        raise BadInput(f"dataset folder {config.data.path} does not exist")
    if not (folder / "dataset.json").is_file():
        raise BadInput(
            f"dataset folder {config.data.path} has no dataset.json (expected the Decathlon layout)"
        )
