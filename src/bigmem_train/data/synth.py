"""A synthetic dataset in exactly the Medical Segmentation Decathlon Task01 (BraTS) layout.

Each case is a head-like phantom: a skull shell, a brain with grey and white matter, two ventricles,
and one tumour (edema around a core of non-enhancing tumour inside an enhancing rim), imaged in four
contrasts (FLAIR, T1w, T1gd, T2w) with a smooth bias field and noise. The background outside the head
is exactly zero, as in the skull-stripped-style BraTS volumes, so the reader's brain mask works alike.
The tumour is bright in FLAIR, so a small U-Net on FLAIR alone learns it within a few epochs.

Layout written (the reader in :mod:`bigmem_train.data.reader` reads it like the real Task01 folder)::

    OUT/dataset.json                 name, modality, labels, numTraining, training[], test[], synthetic{}
    OUT/imagesTr/BRATS_001.nii.gz    int16 (X, Y, Z, 4), 1 mm spacing
    OUT/labelsTr/BRATS_001.nii.gz    uint8 (X, Y, Z): 0 background, 1 edema, 2 non-enhancing, 3 enhancing

Every file is written under a temporary name and renamed when complete; ``dataset.json`` comes last.
A folder holding a complete dataset written with the same parameters is reused as it is.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nibabel as nib
import numpy as np

from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.sizes import format_bytes

# Bump when the generator changes what it writes, so an older dataset is regenerated, not reused.
GENERATOR_VERSION = 2
MODALITIES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
# Written while a dataset is being generated; its presence marks the folder as ours to resume or replace.
IN_PROGRESS_MARKER = ".synthetic-in-progress.json"

# Mean intensity of each tissue in each contrast (FLAIR, T1w, T1gd, T2w), roughly like real MRI:
# CSF dark in FLAIR and bright in T2, edema bright in FLAIR and T2, the rim bright after gadolinium.
_TISSUE_MEANS = {
    "skull": (250.0, 900.0, 900.0, 300.0),
    "grey": (520.0, 450.0, 460.0, 600.0),
    "white": (430.0, 620.0, 630.0, 450.0),
    "csf": (120.0, 200.0, 210.0, 1100.0),
    "edema": (950.0, 380.0, 390.0, 950.0),
    "necrotic": (700.0, 250.0, 260.0, 1000.0),
    "enhancing": (850.0, 420.0, 1100.0, 800.0),
}
_NOISE_SIGMA = 30.0
# Relative variation of a tumour blob's radius with direction.
_WOBBLE = 0.12


# Peak memory of writing one case, per voxel: the int16 four-contrast image (8 B), the label and the
# float32 and boolean volumes the phantom is built from (measured 40 B at 96^3, 37 B at 160^3 for the
# phantom alone, 47 B at 160^3 with the NIfTI writer; rounded up).
CASE_BYTES_PER_VOXEL = 48


def check_case_fits(shape: tuple[int, int, int], room_bytes: int | None = None, room: str = "") -> None:
    """Refuse (:class:`DoesNotFit`, exit 3) a case too large to build in this host's memory, before
    anything is written; ``room_bytes`` defaults to what the host leaves this process."""
    if room_bytes is None:
        from bigmem_train.host import read_host_facts

        facts = read_host_facts()
        room_bytes, room = facts.effective_memory_bytes, facts.limit_in_force
    need = int(np.prod(shape, dtype=np.int64)) * CASE_BYTES_PER_VOXEL
    if need > room_bytes:
        raise DoesNotFit(
            f"synthetic dataset: building one case of {'x'.join(map(str, shape))} needs about "
            f"{format_bytes(need)} of memory; {room or 'this host'} leaves {format_bytes(room_bytes)} "
            "(a smaller data.synthetic_shape, or synth --shape)"
        )


def case_name(index: int) -> str:
    """``BRATS_001`` for index 1, as in Task01."""
    return f"BRATS_{index:03d}"


def write_synthetic_dataset(out_dir: Path, cases: int, shape: tuple[int, int, int], seed: int = 1234) -> Path:
    """Write ``cases`` synthetic cases of ``shape`` (X, Y, Z) into ``out_dir`` and return it.

    Reuses a complete dataset written there before with the same parameters; resumes or replaces an
    incomplete or different synthetic dataset; refuses (:class:`BadInput`) a non-empty folder that is
    not a synthetic dataset.
    """
    out_dir = Path(out_dir)
    shape = tuple(int(edge) for edge in shape)
    if cases < 1:
        raise BadInput(f"synthetic dataset: need at least 1 case, got {cases}")
    if len(shape) != 3 or any(edge < 4 for edge in shape):
        raise BadInput(
            f"synthetic dataset: shape must be three edges of at least 4 voxels, got {list(shape)}"
        )
    parameters = {
        "generator": "bigmem_train.data.synth",
        "version": GENERATOR_VERSION,
        "cases": cases,
        "shape": list(shape),
        "seed": seed,
    }
    # Several processes may ask for the same dataset at once (the workers of a multi-node Slurm job, two
    # jobs on one shared results folder): one writes it, the others wait, then reuse it.
    with _exclusive(out_dir.parent / f".{out_dir.name}.lock"):
        return _write_dataset(out_dir, cases, shape, seed, parameters)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive POSIX lock on ``lock_path`` (NFS passes these between hosts). The file stays: removing
    a lock file lets a waiting process lock the removed file while a new one locks its successor. Where the
    lock cannot be made (a read-only parent folder), nothing is locked: there nothing can be written either."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        yield


def _write_dataset(out_dir: Path, cases: int, shape: tuple[int, ...], seed: int, parameters: dict) -> Path:
    state = _folder_state(out_dir, parameters)
    if state == "complete":
        print(
            f"synthetic dataset: reusing {out_dir} ({cases} cases of {'x'.join(map(str, shape))})",
            file=sys.stderr,
            flush=True,
        )
        return out_dir
    check_case_fits(shape)
    if state == "other-parameters":
        _remove_our_files(out_dir)
    images_dir, labels_dir = out_dir / "imagesTr", out_dir / "labelsTr"
    try:
        images_dir.mkdir(parents=True, exist_ok=True)
        labels_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(out_dir / IN_PROGRESS_MARKER, json.dumps(parameters, indent=2))
    except OSError as error:
        raise BadInput(f"synthetic dataset {out_dir}: cannot write: {error.strerror or error}") from None

    print(
        f"synthetic dataset: writing {cases} cases of {'x'.join(map(str, shape))} to {out_dir}",
        file=sys.stderr,
        flush=True,
    )
    report_every = max(1, cases // 10)
    for index in range(1, cases + 1):
        name = case_name(index)
        image_path, label_path = images_dir / f"{name}.nii.gz", labels_dir / f"{name}.nii.gz"
        # Files appear under their final names only when complete, so an interrupted run resumes here.
        if not (image_path.is_file() and label_path.is_file()):
            image, label = synthesize_case(shape, np.random.default_rng([seed, index]))
            _save_nifti(image, image_path)
            _save_nifti(label, label_path)
        if cases >= 20 and (index % report_every == 0 or index == cases):
            print(f"synthetic dataset: {index}/{cases} cases", file=sys.stderr, flush=True)

    for leftover in [*images_dir.glob(".partial-*"), *labels_dir.glob(".partial-*")]:
        leftover.unlink()  # from an interrupted earlier run
    _write_atomically(out_dir / "dataset.json", json.dumps(_dataset_json(cases, parameters), indent=4))
    (out_dir / IN_PROGRESS_MARKER).unlink(missing_ok=True)
    return out_dir


def _dataset_json(cases: int, parameters: dict) -> dict:
    return {
        "name": "BRATS",
        "description": "Synthetic head phantoms with gliomas in the MSD Task01 layout (bigmem-train synth)",
        "reference": "bigmem-train synthetic generator",
        "licence": "CC-BY-SA 4.0",
        "release": "1.0",
        "tensorImageSize": "4D",
        "modality": MODALITIES,
        "labels": LABELS,
        "numTraining": cases,
        "numTest": 0,
        "training": [
            {
                "image": f"./imagesTr/{case_name(index)}.nii.gz",
                "label": f"./labelsTr/{case_name(index)}.nii.gz",
            }
            for index in range(1, cases + 1)
        ],
        "test": [],
        "synthetic": parameters,
    }


def _folder_state(out_dir: Path, parameters: dict) -> str:
    """ "new" (absent or empty), "complete", "resume" (ours, same parameters), "other-parameters" (ours)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"synthetic dataset {out_dir}: exists and is not a folder")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return "new"
    marker, index_file = out_dir / IN_PROGRESS_MARKER, out_dir / "dataset.json"
    if marker.is_file():
        try:
            previous = json.loads(marker.read_text())
        except (OSError, ValueError):
            previous = None
        return "resume" if previous == parameters else "other-parameters"
    previous = None
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
            previous = index.get("synthetic") if isinstance(index, dict) else None
        except (OSError, ValueError):
            previous = None
    if previous is None:
        raise BadInput(
            f"synthetic dataset {out_dir}: folder is not empty and holds no synthetic dataset; "
            "refusing to overwrite it (choose an empty or new folder)"
        )
    if previous != parameters:
        return "other-parameters"
    complete = all(
        (out_dir / entry["image"]).is_file() and (out_dir / entry["label"]).is_file()
        for entry in index.get("training", [])
    )
    return (
        "complete"
        if complete and len(index.get("training", [])) == parameters["cases"]
        else "other-parameters"
    )


def _remove_our_files(out_dir: Path) -> None:
    """Remove what this generator writes (and nothing else) before writing different parameters."""
    (out_dir / "dataset.json").unlink(missing_ok=True)
    for folder in ("imagesTr", "labelsTr"):
        for path in (out_dir / folder).glob("*BRATS_*.nii.gz"):
            path.unlink()


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".partial-{path.name}")
    partial.write_text(text)
    os.replace(partial, path)


def _save_nifti(data: np.ndarray, path: Path) -> None:
    affine = np.eye(4)  # 1 mm isotropic, RAS-aligned
    image = nib.Nifti1Image(data, affine)
    image.header.set_xyzt_units("mm", "sec")
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    # The partial name keeps the .nii.gz ending so nibabel compresses it.
    partial = path.with_name(f".partial-{path.name}")
    try:
        nib.save(image, partial)
        os.replace(partial, path)
    except OSError as error:
        raise BadInput(f"synthetic dataset: cannot write {path}: {error.strerror or error}") from None


def _smooth_field(rng: np.random.Generator, grids: tuple[np.ndarray, ...], scale: float, waves: int = 3):
    """A smooth random field in about [-1, 1]: a few random low-frequency plane waves."""
    field = None
    for _ in range(waves):
        direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        frequency = 2 * np.pi / scale * rng.uniform(0.5, 1.5)
        phase = float(rng.uniform(0, 2 * np.pi))
        projection = sum(float(direction[axis] * frequency) * grids[axis] for axis in range(3))
        wave = np.cos(projection + phase)
        field = wave if field is None else field + wave
    return field / np.float32(waves)


def _ellipsoid_distance(grids, centre, radii) -> np.ndarray:
    """Normalised distance: < 1 inside the ellipsoid with these centre and semi-axes (sparse grids)."""
    return sum(((grids[axis] - float(centre[axis])) / float(radii[axis])) ** 2 for axis in range(3))


def _blob_distance(rng: np.random.Generator, offsets, radius: float) -> np.ndarray:
    """Normalised distance to an irregular sphere whose radius varies smoothly with direction.

    ``offsets`` are sparse grids of the positions relative to the centre.
    """
    distance = np.sqrt(sum(offset**2 for offset in offsets)) + np.float32(1e-6)
    wobble = np.zeros_like(distance)
    for _ in range(3):
        direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        cosine = sum(float(direction[axis]) * offsets[axis] for axis in range(3)) / distance
        wobble += np.sin(float(rng.uniform(2, 4)) * cosine + float(rng.uniform(0, 2 * np.pi)))
    return distance / (np.float32(radius) * (1.0 + _WOBBLE * wobble))


def synthesize_case(shape: tuple[int, int, int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One phantom: an int16 (X, Y, Z, 4) image and a uint8 (X, Y, Z) label with values 0..3."""
    # Sparse grids: per-axis arrays broadcast on use, so only the results are full volumes.
    grids = np.meshgrid(*(np.arange(edge, dtype=np.float32) for edge in shape), indexing="ij", sparse=True)
    extent = np.array(shape, dtype=np.float64)
    smallest = float(extent.min())

    # Head: an ellipsoid filling most of the volume at a random position and size.
    head_centre = extent / 2 + rng.uniform(-0.03, 0.03, size=3) * extent
    head_radii = extent * rng.uniform(0.40, 0.47, size=3)
    head = _ellipsoid_distance(grids, head_centre, head_radii) < 1
    skull_thickness = max(1.0, 0.07 * smallest)
    brain_radii = head_radii - skull_thickness
    brain_distance = _ellipsoid_distance(grids, head_centre, brain_radii)
    brain = brain_distance < 1
    white = brain_distance < 0.55  # a cortex of grey matter around white matter
    del brain_distance
    ventricles = np.zeros(shape, dtype=bool)
    for side in (-1, 1):
        centre = head_centre + np.array([side * 0.12, 0.02, 0.05]) * brain_radii
        radii = brain_radii * np.array([0.08, 0.30, 0.18]) * rng.uniform(0.8, 1.2, size=3)
        ventricles |= _ellipsoid_distance(grids, centre, np.maximum(radii, 0.8)) < 1

    # Tumour: edema around a core of non-enhancing tumour inside an enhancing rim, inside the brain.
    # Computed in the tumour's bounding box only.
    direction = rng.normal(size=3)
    direction /= np.linalg.norm(direction)
    tumour_centre = head_centre + direction * rng.uniform(0.0, 0.55) * brain_radii
    core_radius = max(1.5, rng.uniform(0.10, 0.17) * smallest)
    edema_radius = core_radius * rng.uniform(1.5, 2.1)
    reach = int(np.ceil(edema_radius * (1 + 3 * _WOBBLE))) + 1
    low = np.clip(np.floor(tumour_centre).astype(int) - reach, 0, shape)
    high = np.clip(np.floor(tumour_centre).astype(int) + reach + 1, 0, shape)
    box = tuple(slice(int(start), int(stop)) for start, stop in zip(low, high))
    offsets = np.meshgrid(
        *(
            np.arange(start, stop, dtype=np.float32) - np.float32(tumour_centre[axis])
            for axis, (start, stop) in enumerate(zip(low, high))
        ),
        indexing="ij",
        sparse=True,
    )
    edema = _blob_distance(rng, offsets, edema_radius) < 1
    core = _blob_distance(rng, offsets, core_radius) < 1
    necrotic = _blob_distance(rng, offsets, core_radius * rng.uniform(0.4, 0.65)) < 1

    label = np.zeros(shape, dtype=np.uint8)
    label_box, brain_box = label[box], brain[box]  # views: writing label_box writes label
    label_box[edema & brain_box] = 1
    label_box[core & brain_box] = 3
    label_box[necrotic & brain_box] = 2

    means = np.array(list(_TISSUE_MEANS.values()), dtype=np.float32)  # (tissues, 4)
    index = {name: position for position, name in enumerate(_TISSUE_MEANS)}
    tissue_index = np.full(shape, index["skull"], dtype=np.int8)
    tissue_index[brain] = index["grey"]
    tissue_index[white] = index["white"]
    tissue_index[ventricles & brain] = index["csf"]
    tissue_index[label == 1] = index["edema"]
    tissue_index[label == 3] = index["enhancing"]
    tissue_index[label == 2] = index["necrotic"]

    image = np.zeros((*shape, 4), dtype=np.int16)
    bias = 1.0 + 0.08 * _smooth_field(rng, grids, scale=smallest)
    texture = 1.0 + 0.05 * _smooth_field(rng, grids, scale=smallest / 4, waves=4)
    for channel in range(4):
        gain = float(rng.uniform(0.85, 1.2))
        volume = means[:, channel][tissue_index] * texture * bias * gain
        volume += rng.standard_normal(size=shape, dtype=np.float32) * np.float32(_NOISE_SIGMA)
        volume = np.where(head, np.clip(volume, 1, 32767), 0)
        image[..., channel] = np.rint(volume).astype(np.int16)
    return image, label
