"""evaluate: Dice and HD95 against MedPy (a well-kept reference), the empty-mask convention, BraTS regions,
the pooled Dice, and the bad inputs it refuses before scoring anything. Only the tests that compare with
MedPy need it (the ``medpy_binary`` fixture); the rest run without it."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from bigmem_train.cli import main
from bigmem_train.errors import BadInput
from bigmem_train.verdict.evaluate import (
    _check_values,
    _load_volume,
    _structures_for,
    dice,
    evaluate_folders,
    hd95,
    score_case,
    structures,
    summarize,
)


@pytest.fixture
def medpy_binary():
    """MedPy's binary metrics (scripts/setup.sh --test installs MedPy); skips only the tests that use it."""
    return pytest.importorskip("medpy.metric.binary")


def _ball(shape, centre, radius, spacing=(1.0, 1.0, 1.0)) -> np.ndarray:
    grid = np.meshgrid(*[np.arange(edge) * step for edge, step in zip(shape, spacing)], indexing="ij")
    return sum((axis - c * step) ** 2 for axis, c, step in zip(grid, centre, spacing)) <= radius**2


def _blobs(rng, shape) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    noise = gaussian_filter(rng.standard_normal(shape), sigma=rng.uniform(1.0, 3.0))
    return noise > rng.uniform(0.05, 0.4) * noise.std()


CRAFTED = [
    # (predicted, true, spacing): shifted cubes, anisotropic voxels, a ball against an off-centre ball,
    # one voxel against a slab, objects touching the volume's border.
    (
        np.pad(np.ones((6, 6, 6), bool), 5),
        np.pad(np.ones((6, 6, 6), bool), ((7, 3), (5, 5), (5, 5))),
        (1.0, 1.0, 1.0),
    ),
    (
        np.pad(np.ones((6, 6, 6), bool), 5),
        np.pad(np.ones((6, 6, 6), bool), ((7, 3), (5, 5), (5, 5))),
        (0.7, 1.3, 3.0),
    ),
    (_ball((30, 30, 20), (15, 15, 10), 7), _ball((30, 30, 20), (17, 13, 9), 5), (1.0, 1.0, 2.5)),
    (
        np.pad(np.ones((1, 1, 1), bool), ((4, 5), (4, 5), (4, 5))),
        np.pad(np.ones((10, 10, 2), bool), ((0, 0), (0, 0), (3, 5))),
        (1.0, 1.0, 1.0),
    ),
    (np.ones((8, 9, 10), bool), np.pad(np.ones((4, 9, 10), bool), ((4, 0), (0, 0), (0, 0))), (2.0, 1.0, 1.0)),
]


@pytest.mark.parametrize("predicted, true, spacing", CRAFTED)
def test_crafted_cases_match_medpy(medpy_binary, predicted, true, spacing):
    assert dice(predicted, true) == pytest.approx(medpy_binary.dc(predicted, true), abs=1e-12)
    assert hd95(predicted, true, spacing) == pytest.approx(
        medpy_binary.hd95(predicted, true, voxelspacing=spacing), abs=1e-9
    )


def test_random_cases_match_medpy(medpy_binary):
    rng = np.random.default_rng(7)
    compared = 0
    for _ in range(24):
        shape = tuple(int(edge) for edge in rng.integers(12, 40, size=3))
        spacing = tuple(float(step) for step in rng.uniform(0.5, 3.0, size=3))
        predicted, true = _blobs(rng, shape), _blobs(rng, shape)
        if not predicted.any() or not true.any():
            continue
        assert dice(predicted, true) == pytest.approx(medpy_binary.dc(predicted, true), abs=1e-12)
        assert hd95(predicted, true, spacing) == pytest.approx(
            medpy_binary.hd95(predicted, true, voxelspacing=spacing), abs=1e-9
        )
        compared += 1
    assert compared >= 20


def test_empty_masks_follow_the_stated_convention():
    empty = np.zeros((240, 240, 155), bool)
    some = empty.copy()
    some[100:110, 100:110, 70:80] = True
    assert dice(empty, empty) == 1.0 and hd95(empty, empty, (1.0, 1.0, 1.0)) == 0.0
    # One side empty: Dice 0 and the volume's diagonal, BraTS' 373.13 mm at 240x240x155 and 1 mm.
    assert dice(some, empty) == 0.0 and dice(empty, some) == 0.0
    assert hd95(some, empty, (1.0, 1.0, 1.0)) == pytest.approx(373.13, abs=0.01)
    assert hd95(empty, some, (1.0, 1.0, 2.0)) == pytest.approx(float(np.sqrt(240**2 + 240**2 + 310**2)))


def test_brats_regions_pool_the_decathlon_labels():
    true = np.zeros((20, 20, 20), np.int32)
    true[2:8, 2:8, 2:8] = 1  # edema
    true[4:6, 4:6, 4:6] = 2  # non-enhancing
    true[5, 5, 5] = 3  # enhancing
    predicted = true.copy()
    predicted[predicted == 2] = 3  # non-enhancing called enhancing: tumour core stays right
    named = structures("multiclass", 4, {0, 1, 2, 3})
    assert set(named) == {"edema", "non-enhancing tumour", "enhancing tumour", "whole tumour", "tumour core"}
    scores = {score.structure: score for score in score_case("c", predicted, true, (1.0, 1.0, 1.0), named)}
    assert scores["whole tumour"].dice == 1.0 and scores["tumour core"].dice == 1.0
    assert scores["non-enhancing tumour"].dice == 0.0
    assert scores["enhancing tumour"].dice == pytest.approx(2 * 1 / (8 + 1))
    assert scores["edema"].true_voxels == 6**3 - 2**3


def _voxels(shape, values: dict[tuple[int, int, int], int]) -> np.ndarray:
    volume = np.zeros(shape, np.int32)
    for index, value in values.items():
        volume[index] = value
    return volume


def test_tumour_core_is_labels_2_and_3_without_the_edema():
    # Four tumour voxels in a row; the prediction calls the edema voxel at x=3 non-enhancing.
    #   true:      x=0 -> 2, x=1 -> 3, x=2 -> 1, x=3 -> 1
    #   predicted: x=0 -> 2, x=1 -> 3, x=2 -> 1, x=3 -> 2
    true = _voxels((6, 3, 3), {(0, 1, 1): 2, (1, 1, 1): 3, (2, 1, 1): 1, (3, 1, 1): 1})
    predicted = _voxels((6, 3, 3), {(0, 1, 1): 2, (1, 1, 1): 3, (2, 1, 1): 1, (3, 1, 1): 2})
    named = structures("multiclass", 4, {0, 1, 2, 3})
    scores = {score.structure: score for score in score_case("c", predicted, true, (1.0, 1.0, 1.0), named)}
    # Tumour core {2, 3}: true {x0, x1}, predicted {x0, x1, x3}: 2 x 2 / (3 + 2) = 0.8.
    # (With the edema in it, {1, 2, 3}, both are {x0..x3}: Dice 1.0, the whole tumour's.)
    core = scores["tumour core"]
    assert (core.true_voxels, core.predicted_voxels, core.intersection_voxels) == (2, 3, 2)
    assert core.dice == pytest.approx(0.8)
    # Whole tumour {1, 2, 3}: all four voxels on both sides: 1.0. Enhancing {3}: x1 on both: 1.0.
    assert scores["whole tumour"].dice == 1.0 and scores["whole tumour"].true_voxels == 4
    assert scores["enhancing tumour"].dice == 1.0 and scores["enhancing tumour"].true_voxels == 1
    # Edema (1): true {x2, x3}, predicted {x2}: 2 x 1 / (1 + 2) = 2/3. Non-enhancing (2): true {x0},
    # predicted {x0, x3}: 2 x 1 / (2 + 1) = 2/3.
    assert scores["edema"].dice == pytest.approx(2 / 3)
    assert scores["non-enhancing tumour"].dice == pytest.approx(2 / 3)


def test_pooled_dice_sums_every_case_before_dividing():
    # Case a: 2 true voxels, both predicted: Dice 2 x 2 / (2 + 2) = 1.
    # Case b: 8 true voxels, 4 of them predicted and nothing else: Dice 2 x 4 / (4 + 8) = 2/3.
    # Mean of the two: (1 + 2/3) / 2 = 0.8333; median the same (two cases).
    # Pooled: 2 x (2 + 4) / ((2 + 2) + (4 + 8)) = 12 / 16 = 0.75.
    shape = (4, 4, 4)
    true_a = _voxels(shape, {(0, 0, 0): 1, (0, 0, 1): 1})
    true_b = np.zeros(shape, np.int32)
    true_b[:2, :2, :2] = 1
    predicted_b = np.zeros(shape, np.int32)
    predicted_b[:1, :2, :2] = 1
    named = {"foreground": ()}
    scores = score_case("a", true_a.copy(), true_a, (1.0, 1.0, 1.0), named)
    scores += score_case("b", predicted_b, true_b, (1.0, 1.0, 1.0), named)
    summary = summarize(scores, ["foreground"])["summary"]["foreground"]
    assert summary["cases"] == 2
    assert summary["pooled_dice"] == 0.75
    assert summary["mean_dice"] == pytest.approx(0.8333, abs=1e-4)
    assert summary["median_dice"] == pytest.approx(0.8333, abs=1e-4)


def _write(path, data, affine=None, zooms=(1.0, 1.0, 1.0)):
    image = nib.Nifti1Image(np.asarray(data), np.diag([*zooms, 1.0]) if affine is None else affine)
    image.header.set_zooms(zooms)
    nib.save(image, path)


def _folders(tmp_path, cases=3):
    rng = np.random.default_rng(3)
    pred, labels = tmp_path / "pred", tmp_path / "labels"
    pred.mkdir()
    labels.mkdir()
    for index in range(cases):
        true = _ball((24, 24, 16), (12 + index, 12, 8), 5)
        predicted = true ^ (rng.random(true.shape) < 0.01)
        _write(labels / f"case_{index}.nii.gz", true.astype(np.uint8), zooms=(1.0, 1.0, 2.0))
        _write(pred / f"case_{index}.nii.gz", predicted.astype(np.uint8), zooms=(1.0, 1.0, 2.0))
    return pred, labels


def test_evaluate_writes_json_csv_html_and_a_plot(tmp_path):
    pred, labels = _folders(tmp_path)
    assert (
        main(["evaluate", "--pred", str(pred), "--labels", str(labels), "--out", str(tmp_path / "out")]) == 0
    )
    result = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert len(result["cases"]) == 3 and set(result["summary"]) == {"foreground"}
    row = result["cases"][0]
    true = np.asanyarray(nib.load(labels / "case_0.nii.gz").dataobj) > 0
    predicted = np.asanyarray(nib.load(pred / "case_0.nii.gz").dataobj) > 0
    # Dice by its definition, 2 |P & T| / (|P| + |T|); each voxel 1 x 1 x 2 mm = 0.002 ml.
    assert row["dice"] == pytest.approx(
        2 * (predicted & true).sum() / (predicted.sum() + true.sum()), abs=1e-4
    )
    assert row["true_ml"] == pytest.approx(true.sum() * 2 / 1000, abs=1e-3)
    csv_lines = (tmp_path / "out" / "evaluation.csv").read_text().splitlines()
    assert len(csv_lines) == 4 and csv_lines[0].startswith("case,structure,dice,hd95_mm")
    page = (tmp_path / "out" / "evaluation.html").read_text()
    assert "case_2" in page and "evaluation.png" in page and "BraTS" in page
    assert (tmp_path / "out" / "evaluation.png").stat().st_size > 1000


def test_evaluated_rows_match_medpy_with_the_headers_spacing(medpy_binary, tmp_path):
    pred, labels = _folders(tmp_path)
    result = evaluate_folders(pred, labels, tmp_path / "out")
    for row in result["cases"]:
        true = np.asanyarray(nib.load(labels / f"{row['case']}.nii.gz").dataobj) > 0
        predicted = np.asanyarray(nib.load(pred / f"{row['case']}.nii.gz").dataobj) > 0
        assert row["dice"] == pytest.approx(medpy_binary.dc(predicted, true), abs=1e-4)
        assert row["hd95_mm"] == pytest.approx(
            medpy_binary.hd95(predicted, true, voxelspacing=(1, 1, 2)), abs=0.01
        )


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("missing_label", "no label for 1 predicted case(s): case_1"),
        ("shape", "label shape [24, 24, 15] differs from its prediction's [24, 24, 16]"),
        ("orientation", "voxel axes LAS differ from its prediction's RAS"),
        ("class", "value 5 is not one of the model's 4 classes"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(tmp_path, capsys, breakage, message):
    pred, labels = _folders(tmp_path)
    if breakage == "missing_label":
        (labels / "case_1.nii.gz").unlink()
    elif breakage == "shape":
        _write(labels / "case_1.nii.gz", np.zeros((24, 24, 15), np.uint8))
    elif breakage == "orientation":
        _write(
            labels / "case_1.nii.gz", np.zeros((24, 24, 16), np.uint8), affine=np.diag([-1.0, 1.0, 2.0, 1.0])
        )
    else:
        (pred / "predict.json").write_text(json.dumps({"label_mode": "multiclass", "output_classes": 4}))
        _write(labels / "case_0.nii.gz", np.full((24, 24, 16), 5, np.uint8))
    assert main(["evaluate", "--pred", str(pred), "--labels", str(labels)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (pred / "evaluation.json").exists()


def test_a_folder_without_masks_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="no .nii or .nii.gz masks"):
        evaluate_folders(tmp_path / "empty", tmp_path)


# --- what is scored, and which values are refused (gaps 9-13 of docs/results/mutation-testing.md) ---


def test_a_label_equal_to_the_class_count_is_refused_and_the_last_class_is_not():
    paths = (Path("pred.nii.gz"), Path("label.nii.gz"))
    last, beyond = np.full((2, 2, 2), 3), np.full((2, 2, 2), 4)
    _check_values(4, False, last, last, paths)  # classes 0..3
    with pytest.raises(BadInput, match=r"pred.nii.gz: value 4 is not one of the model's 4 classes \(0..3\)"):
        _check_values(4, False, beyond, last, paths)
    with pytest.raises(BadInput, match=r"label.nii.gz: value 4 is not one of the model's 4 classes"):
        _check_values(4, False, last, beyond, paths)
    # A binary model's mask holds 0 and 1; its label may hold any class (every value above 0 is foreground).
    _check_values(2, True, np.ones((2, 2, 2)), np.full((2, 2, 2), 3), paths)
    with pytest.raises(BadInput, match="pred.nii.gz: values above 1 in a binary model's mask"):
        _check_values(2, True, np.full((2, 2, 2), 2), np.ones((2, 2, 2)), paths)


def test_brats_names_and_regions_only_for_four_classes_of_the_decathlons_values():
    regions = {"whole tumour": (1, 2, 3), "tumour core": (2, 3), "enhancing tumour": (3,)}
    brats = structures("multiclass", 4, {0, 1, 2, 3})
    assert brats == {
        "edema": (1,),
        "non-enhancing tumour": (2,),
        "enhancing tumour": (3,),
        **regions,
    }
    assert structures("multiclass", 4, {0, 2}) == brats  # a case without every label is still BraTS
    # Four classes whose labels are not BraTS': numbered classes, no regions.
    assert structures("multiclass", 4, {0, 1, 5}) == {"class 1": (1,), "class 2": (2,), "class 3": (3,)}
    assert structures("multiclass", 3, {0, 1, 2}) == {"class 1": (1,), "class 2": (2,)}
    assert structures("binary", 4, {0, 1, 2, 3}) == {"foreground": ()}
    assert structures("multiclass", 1, {0, 1}) == {"foreground": ()}


def test_without_predict_json_the_classes_come_from_the_masks_values():
    zeros = np.zeros((2, 2, 2), np.int32)
    two = zeros.copy()
    two[0, 0, 0] = 2
    one = zeros.copy()
    one[0, 0, 0] = 1
    # Values 0..2 in either mask: three classes, each scored on its own.
    assert _structures_for({}, two, one) == (3, {"class 1": (1,), "class 2": (2,)})
    assert _structures_for({}, one, two) == (3, {"class 1": (1,), "class 2": (2,)})
    # Two values or fewer: one foreground.
    assert _structures_for({}, one, one) == (2, {"foreground": ()})
    assert _structures_for({}, zeros, zeros) == (2, {"foreground": ()})
    # predict.json's word wins over the values: its class count, or binary.
    assert _structures_for({"output_classes": 4}, one, one)[0] == 4
    assert _structures_for({"label_mode": "binary", "output_classes": 4}, two, two) == (2, {"foreground": ()})


def test_pooled_dice_of_cases_that_are_all_empty_is_one():
    empty = np.zeros((4, 4, 4), np.int32)
    named = {"foreground": ()}
    scores = score_case("a", empty, empty, (1.0, 1.0, 1.0), named) + score_case(
        "b", empty, empty, (1.0, 1.0, 1.0), named
    )
    assert summarize(scores, ["foreground"])["summary"]["foreground"]["pooled_dice"] == 1.0


@pytest.mark.parametrize(
    ("data", "stored", "expected"),
    [
        # A float mask of whole numbers, as some tools save labels: read as class indices.
        (np.array([0.0, 1.0, 2.0, 3.0]).reshape(1, 2, 2), np.float32, [0, 1, 2, 3]),
        # A 4D file whose last axis has one entry: read as the 3D volume it is.
        (np.array([0, 1, 1, 0], np.uint8).reshape(1, 2, 2, 1), np.uint8, [0, 1, 1, 0]),
    ],
)
def test_masks_stored_as_floats_or_with_a_trailing_axis_of_one_read_as_class_indices(
    tmp_path, data, stored, expected
):
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(data.astype(stored), np.eye(4)), path)
    _, volume = _load_volume(path)
    assert volume.shape == (1, 2, 2) and volume.dtype == np.int32
    assert volume.ravel().tolist() == expected


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0.0, 1.0, np.nan, 0.0], "NaN or infinite"),
        ([0.0, 1.0, 0.5, 0.0], "holds 1 non-integer value"),
        ([0.0, -1.0, 0.0, 0.0], "holds negative values"),
    ],
)
def test_a_float_mask_that_is_not_class_indices_is_refused(tmp_path, values, message):
    path = tmp_path / "case.nii.gz"
    _write(path, np.array(values, np.float32).reshape(1, 2, 2))
    with pytest.raises(BadInput, match=message):
        _load_volume(path)
