"""``bigmem-train evaluate``: score predicted masks against labels the way the field reports segmentation.

Per case and per class (and, for the Decathlon's BraTS labels 1 edema, 2 non-enhancing and 3 enhancing
tumour, the regions whole tumour {1,2,3}, tumour core {2,3} and enhancing tumour {3}): Dice, the 95th
percentile Hausdorff distance in millimetres (voxel sizes from the label's header; distances from each
surface to the other, both directions pooled, as MedPy's ``hd95``), and the predicted and true volumes.
Also the Dice pooled over all cases (every case's intersection and sizes summed, then divided once).

Empty masks (the stated convention, the BraTS challenge's): prediction and label both empty: Dice 1.0 and
HD95 0 mm; one of them empty: Dice 0.0 and HD95 the volume's diagonal in millimetres (the largest distance
the volume allows: 373.1 mm for a 240x240x155 volume at 1 mm, the value BraTS uses).

Dice and HD95 are checked against MedPy's ``dc`` and ``hd95`` on crafted and random cases
(tests/unit/test_evaluate.py). Distances are computed inside the bounding box of both masks, which holds
every surface voxel and so gives the same nearest distances as the whole volume, in a fraction of the time.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from bigmem_train.data.reader import (
    _READ_ERRORS,
    NIFTI_SUFFIXES,
    _case_name,
    _check_complete,
    _load_header,
    _orientation,
    _reason,
    check_class_values,
    check_real_type,
)
from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.infer.nifti import PARTIAL_PREFIX, check_out_dir, write_error

# The Decathlon's Task01 (BraTS) label values and the regions the challenge reports.
BRATS_CLASSES = {1: "edema", 2: "non-enhancing tumour", 3: "enhancing tumour"}
BRATS_REGIONS = {"whole tumour": (1, 2, 3), "tumour core": (2, 3), "enhancing tumour": (3,)}
CONVENTION = (
    "both empty: Dice 1.0, HD95 0 mm; one empty: Dice 0.0, HD95 the volume's diagonal in mm "
    "(BraTS' convention)"
)
RESULT_FILES = ("evaluation.json", "evaluation.csv", "evaluation.html", "evaluation.png")


@dataclass(frozen=True)
class Score:
    case: str
    structure: str  # a class ("class 2", "edema", "foreground") or a region ("whole tumour")
    dice: float
    hd95_mm: float
    predicted_voxels: int
    true_voxels: int
    intersection_voxels: int
    predicted_ml: float
    true_ml: float


def _surface(mask: np.ndarray) -> np.ndarray:
    from scipy.ndimage import binary_erosion, generate_binary_structure

    return mask ^ binary_erosion(mask, structure=generate_binary_structure(mask.ndim, 1), iterations=1)


def _directed_distances(source: np.ndarray, target: np.ndarray, spacing: tuple[float, ...]) -> np.ndarray:
    """Distances (mm) from every surface voxel of ``source`` to the nearest surface voxel of ``target``."""
    from scipy.ndimage import distance_transform_edt

    target_surface = _surface(target)
    distances = distance_transform_edt(~target_surface, sampling=spacing)
    return distances[_surface(source)]


def dice(predicted: np.ndarray, true: np.ndarray) -> float:
    total = int(np.count_nonzero(predicted)) + int(np.count_nonzero(true))
    if total == 0:
        return 1.0
    return 2.0 * int(np.count_nonzero(predicted & true)) / total


def hd95(predicted: np.ndarray, true: np.ndarray, spacing: tuple[float, ...]) -> float:
    """The 95th percentile of the symmetric surface distance in mm, with the empty-mask convention."""
    has_predicted, has_true = bool(predicted.any()), bool(true.any())
    if not has_predicted and not has_true:
        return 0.0
    if not has_predicted or not has_true:
        return float(
            math.dist([0.0] * predicted.ndim, [edge * step for edge, step in zip(predicted.shape, spacing)])
        )
    union = predicted | true
    box = tuple(
        slice(max(int(indices.min()) - 1, 0), int(indices.max()) + 2) for indices in np.nonzero(union)
    )
    predicted, true = predicted[box], true[box]
    both = np.hstack(
        (_directed_distances(predicted, true, spacing), _directed_distances(true, predicted, spacing))
    )
    return float(np.percentile(both, 95))


def structures(label_mode: str, classes: int, label_values: set[int]) -> dict[str, tuple[int, ...]]:
    """What is scored: one foreground for binary masks; each class and, for BraTS labels, the regions."""
    if label_mode == "binary" or classes == 1:
        return {"foreground": ()}
    brats = classes == 4 and label_values <= {0, 1, 2, 3}
    named = {(BRATS_CLASSES[value] if brats else f"class {value}"): (value,) for value in range(1, classes)}
    if brats:
        named.update(BRATS_REGIONS)
    return named


def _mask(volume: np.ndarray, values: tuple[int, ...]) -> np.ndarray:
    return volume > 0 if not values else np.isin(volume, values)


def score_case(
    name: str,
    predicted: np.ndarray,
    true: np.ndarray,
    spacing: tuple[float, ...],
    named: dict[str, tuple[int, ...]],
) -> list[Score]:
    voxel_ml = math.prod(spacing) / 1000.0
    scores = []
    for structure, values in named.items():
        p, t = _mask(predicted, values), _mask(true, values)
        p_voxels, t_voxels = int(np.count_nonzero(p)), int(np.count_nonzero(t))
        scores.append(
            Score(
                case=name,
                structure=structure,
                dice=dice(p, t),
                hd95_mm=hd95(p, t, spacing),
                predicted_voxels=p_voxels,
                true_voxels=t_voxels,
                intersection_voxels=int(np.count_nonzero(p & t)),
                predicted_ml=round(p_voxels * voxel_ml, 4),
                true_ml=round(t_voxels * voxel_ml, 4),
            )
        )
    return scores


def _nifti_files(folder: Path) -> dict[str, Path]:
    files = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith(".") or not path.name.endswith(NIFTI_SUFFIXES):
            continue
        name = _case_name(path)
        if name.endswith("_probabilities"):
            continue
        files[name] = path
    return files


def _load_volume(path: Path) -> tuple[nib.Nifti1Image, np.ndarray]:
    """A mask or label as (X, Y, Z) class indices, or BadInput naming the file: unreadable, damaged or
    truncated (streamed once to its end), not 3D, values that are not class indices, voxel sizes that
    are not positive."""
    image = _load_header(path)
    check_real_type(path, image)
    shape = tuple(int(edge) for edge in image.shape)
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]
    if len(shape) != 3:
        raise BadInput(f"{path}: a mask must be 3D, got shape {list(image.shape)}")
    spacing = image.header.get_zooms()[:3]
    if not all(math.isfinite(step) and step > 0 for step in spacing):
        raise BadInput(
            f"{path}: voxel sizes {[float(step) for step in spacing]} in its header are not all positive; "
            f"HD95 and volumes are in millimetres"
        )
    _check_complete(path, image)
    try:
        data = np.asanyarray(image.dataobj).reshape(shape)
    except _READ_ERRORS as error:
        raise BadInput(f"{path}: not a readable NIfTI file ({_reason(error)})") from None
    except MemoryError:
        raise DoesNotFit(
            f"{path}: a {'x'.join(map(str, shape))} volume does not fit this host's memory to be scored"
        ) from None
    check_class_values(path, data)
    return image, data.astype(np.int32)


def pair_cases(pred_dir: Path, labels_dir: Path) -> list[tuple[str, Path, Path]]:
    """(case, prediction, label) for every prediction in ``pred_dir``; BadInput for a missing label."""
    for flag, folder in (("--pred", pred_dir), ("--labels", labels_dir)):
        if not folder.exists():
            raise BadInput(f"{flag} {folder}: does not exist")
        if not folder.is_dir():
            raise BadInput(f"{flag} {folder}: not a folder")
    if pred_dir.resolve() == labels_dir.resolve():
        raise BadInput(
            f"--pred {pred_dir} and --labels {labels_dir} are the same folder: every mask would be scored "
            f"against itself"
        )
    predictions, labels = _nifti_files(pred_dir), _nifti_files(labels_dir)
    if not predictions:
        raise BadInput(f"--pred {pred_dir}: no .nii or .nii.gz masks in it")
    if not labels:
        raise BadInput(f"--labels {labels_dir}: no .nii or .nii.gz labels in it")
    missing = [name for name in predictions if name not in labels]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        named = ", ".join(list(labels)[:3]) + (", ..." if len(labels) > 3 else "")
        raise BadInput(
            f"--labels {labels_dir}: no label for {len(missing)} predicted case(s): {shown} "
            f"(labels are matched by file name; these are named {named})"
        )
    return [(name, path, labels[name]) for name, path in predictions.items()]


def _prediction_meta(pred_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((pred_dir / "predict.json").read_text())
    except (OSError, ValueError):
        return {}


def evaluate_folders(pred_dir: Path, labels_dir: Path, out_dir: Path | None = None) -> dict[str, Any]:
    """Score every prediction in ``pred_dir`` against its label; write evaluation.{json,csv,html,png}."""
    pairs = pair_cases(pred_dir, labels_dir)
    # Before any case is scored, and without creating it: a refused evaluation leaves nothing behind.
    check_out_dir(out_dir or pred_dir, "--out" if out_dir else "--pred", create=False)
    return evaluate_pairs(
        pairs, _prediction_meta(pred_dir), out_dir or pred_dir, str(pred_dir), str(labels_dir)
    )


def evaluate_pairs(
    pairs: list[tuple[str, Path, Path]],
    meta: dict[str, Any],
    out_dir: Path,
    predictions: str = "",
    labels: str = "",
) -> dict[str, Any]:
    """Score (case, prediction, label) pairs; ``meta`` is predict.json (label mode, classes) or {}."""
    scores: list[Score] = []
    named: dict[str, tuple[int, ...]] | None = None
    classes = 2
    started = last_line = time.monotonic()
    for number, (name, predicted_path, label_path) in enumerate(pairs, start=1):
        predicted_image, predicted = _load_volume(predicted_path)
        label_image, true = _load_volume(label_path)
        if predicted.shape != true.shape:
            raise BadInput(
                f"{label_path}: label shape {list(true.shape)} differs from its prediction's {list(predicted.shape)}"
            )
        label_axes, predicted_axes = _orientation(label_image), _orientation(predicted_image)
        if label_axes and predicted_axes and label_axes != predicted_axes:
            raise BadInput(
                f"{label_path}: voxel axes {label_axes} differ from its prediction's {predicted_axes} "
                f"({predicted_path}); resample one to the other first"
            )
        if named is None:
            classes, named = _structures_for(meta, predicted, true)
        _check_values(classes, "foreground" in named, predicted, true, (predicted_path, label_path))
        spacing = tuple(float(step) for step in label_image.header.get_zooms()[:3])
        scores.extend(score_case(name, predicted, true, spacing, named))
        now = time.monotonic()
        if now - last_line >= 5 or number == len(pairs):
            print(
                f"evaluate: {number}/{len(pairs)} cases ({now - started:.0f} s)", file=sys.stderr, flush=True
            )
            last_line = now
    result = summarize(scores, list(named or {}))
    result.update({"predictions": predictions, "labels": labels, "convention": CONVENTION})
    write_results(result, scores, out_dir)
    return result


def _structures_for(meta: dict[str, Any], predicted: np.ndarray, true: np.ndarray) -> tuple[int, dict]:
    """(classes, what is scored): from predict.json when the masks came from ``predict``, else from the
    values of the first case (2 values or fewer: one foreground)."""
    if meta.get("label_mode") == "binary":
        return 2, {"foreground": ()}
    classes = int(
        meta.get("output_classes") or max(int(predicted.max(initial=0)), int(true.max(initial=0))) + 1
    )
    if classes <= 2:
        return 2, {"foreground": ()}
    return classes, structures("multiclass", classes, set(np.unique(true).tolist()))


def _check_values(classes: int, binary: bool, predicted: np.ndarray, true: np.ndarray, paths) -> None:
    predicted_path, label_path = paths
    if binary:
        # One foreground: a binary model's masks are scored against every label value above 0.
        if int(predicted.max(initial=0)) > 1:
            raise BadInput(f"{predicted_path}: values above 1 in a binary model's mask")
        return
    for path, volume in ((predicted_path, predicted), (label_path, true)):
        if int(volume.max(initial=0)) >= classes:
            raise BadInput(
                f"{path}: value {int(volume.max())} is not one of the model's {classes} classes (0..{classes - 1})"
            )


def summarize(scores: list[Score], order: list[str]) -> dict[str, Any]:
    """Per structure: mean, median of per-case Dice and HD95, and the Dice pooled over all cases."""
    summary = {}
    for structure in order:
        rows = [score for score in scores if score.structure == structure]
        if not rows:
            continue
        total = sum(row.predicted_voxels + row.true_voxels for row in rows)
        pooled = 1.0 if total == 0 else 2.0 * sum(row.intersection_voxels for row in rows) / total
        summary[structure] = {
            "cases": len(rows),
            "mean_dice": round(float(np.mean([row.dice for row in rows])), 4),
            "median_dice": round(float(np.median([row.dice for row in rows])), 4),
            "pooled_dice": round(pooled, 4),
            "mean_hd95_mm": round(float(np.mean([row.hd95_mm for row in rows])), 2),
            "median_hd95_mm": round(float(np.median([row.hd95_mm for row in rows])), 2),
        }
    return {
        "summary": summary,
        "cases": [
            {**score.__dict__, "dice": round(score.dice, 4), "hd95_mm": round(score.hd95_mm, 2)}
            for score in scores
        ],
    }


def write_results(result: dict[str, Any], scores: list[Score], out_dir: Path) -> None:
    """evaluation.{json,csv,html,png}, written in a hidden folder inside ``out_dir`` and then moved in: a
    write that fails (a full filesystem: exit 3) leaves no partial file and the previous results whole."""
    from bigmem_train.verdict.evaluation_report import write_evaluation_html

    staging = out_dir / f"{PARTIAL_PREFIX}evaluation"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        (staging / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
        with (staging / "evaluation.csv").open("w", newline="") as file:
            writer = csv.DictWriter(
                file, fieldnames=list(result["cases"][0]) if result["cases"] else ["case"]
            )
            writer.writeheader()
            writer.writerows(result["cases"])
        write_evaluation_html(result, staging)
        for name in RESULT_FILES:
            if (staging / name).is_file():
                os.replace(staging / name, out_dir / name)
    except OSError as error:
        raise write_error(out_dir / Path(error.filename).name if error.filename else out_dir, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
