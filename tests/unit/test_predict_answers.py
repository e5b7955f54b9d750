"""predict's answers, not only their shapes: the tile weight is nnU-Net's Gaussian (sigma an eighth of the
tile), tiles of a network that sees its neighbours blend close to the whole volume's answer, mirroring
(--tta) averages a network over its eight flips, whole and in tiles, and several classes become the most
probable one.

``box_sigmoid`` is a stand-in engine with spatial context (a zero-padded box mean, then a steep sigmoid):
a tile's border voxels miss the neighbours outside it, so how the tiles are weighted shows in the answer.
The whole volume's answer is computed here with scipy, not by predict.
"""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import yaml
from scipy import ndimage

from bigmem_train.config import load_config
from bigmem_train.infer.predict import (
    PredictRequest,
    gaussian_weights,
    labels_from,
    predict,
    predict_probabilities,
)
from bigmem_train.infer.source import ModelSource, resolve_images
from bigmem_train.memory.inference import plan_volume
from tests.fixtures.common import recorded_layer_table

BOX_EDGE = 5
# The sigmoid's steepness: probabilities spread over (0, 1), so a blending error moves voxels across 0.5.
BOX_STEEPNESS = 8.0


def box_sigmoid(volume):
    """A stand-in network for a (1, X, Y, Z, 1) volume: each voxel sees the mean of its 5x5x5 neighbourhood
    (zeros outside the volume it is given)."""
    mean = ndimage.uniform_filter(volume[0, ..., 0], size=BOX_EDGE, mode="constant", cval=0.0)
    return (1 / (1 + np.exp(-BOX_STEEPNESS * mean)))[None, ..., None].astype(np.float32)


def dice(first: np.ndarray, second: np.ndarray) -> float:
    return 2 * np.count_nonzero(first & second) / (np.count_nonzero(first) + np.count_nonzero(second))


def small_job():
    """The config and recorded layer table the blending tests plan with (depth 2: edges in steps of 4)."""
    config = load_config(None, {"model.depth": 2, "model.base_filters": 4, "data.channels": [0]})
    return config, recorded_layer_table("unet_depth3_filters8_float32")


def smooth_image(shape, seed):
    """A smooth normalized one-channel image (X, Y, Z, 1): structures several voxels wide."""
    smooth = ndimage.gaussian_filter(np.random.default_rng(seed).standard_normal(shape), 1.5)
    return (smooth / smooth.std()).astype(np.float32)[..., None]


def box_answer(image):
    """box_sigmoid's answer on the whole image, computed here with scipy."""
    return 1 / (1 + np.exp(-BOX_STEEPNESS * ndimage.uniform_filter(image[..., 0], BOX_EDGE, mode="constant")))


def test_the_tile_weight_is_a_gaussian_with_sigma_an_eighth_of_the_tile():
    # exp(-((i - centre)**2 - (nearest offset)**2) / (2 sigma**2)) worked by hand per axis: the exponents
    # for edge 8 (sigma 1, centre 3.5), edge 16 (sigma 2, centre 7.5) and edge 4 (sigma 0.5, centre 1.5).
    edge_8 = [6, 3, 1, 0, 0, 1, 3, 6]
    edge_16 = [7, 5.25, 3.75, 2.5, 1.5, 0.75, 0.25, 0, 0, 0.25, 0.75, 1.5, 2.5, 3.75, 5.25, 7]
    edge_4 = [4, 0, 0, 4]
    exponents = np.add.outer(np.add.outer(edge_8, edge_16), edge_4)
    weights = gaussian_weights((8, 16, 4))
    assert weights.shape == (8, 16, 4) and weights.dtype == np.float32
    np.testing.assert_allclose(weights, np.exp(-exponents), rtol=1e-5, atol=0)
    # The corner of an 8-voxel cube: e**-18 of the centre, three axes at e**-6 each.
    assert gaussian_weights((8, 8, 8))[0, 0, 0] == pytest.approx(np.exp(-18.0), rel=1e-5)


@pytest.mark.parametrize("tta", [False, True])
def test_tiles_of_a_network_with_context_blend_close_to_the_whole_volumes_answer(tta):
    config, table = small_job()
    shape = (38, 35, 27)  # padded to 40x36x28: the padding is zeros, as the box's outside is
    image = smooth_image(shape, 0)
    expected = box_answer(image)
    whole = plan_volume(config, table, shape, 1, None)
    tiled = plan_volume(config, table, shape, 1, None, window=(16, 16, 16))
    assert whole.mode == "whole" and tiled.mode == "tiles" and tiled.tiles == 48
    np.testing.assert_allclose(
        predict_probabilities(box_sigmoid, image, whole, tta=tta)[..., 0], expected, rtol=0, atol=1e-5
    )
    blended = predict_probabilities(box_sigmoid, image, tiled, tta=tta)[..., 0]
    error = np.abs(blended - expected)
    # Gaussian weights, sigma an eighth of the tile: mean error 2e-4, largest 5e-3, Dice 0.9998. Uniform
    # weights: mean 0.03, largest 0.43, Dice 0.974; sigma half the tile: mean 0.026, largest 0.36, Dice 0.98.
    assert error.mean() < 0.002, f"mean error {error.mean():.4f}: tile borders weigh too much"
    assert error.max() < 0.05, f"largest error {error.max():.4f}: tile borders weigh too much"
    assert dice(blended >= 0.5, expected >= 0.5) >= 0.996


def test_one_class_is_thresholded_at_a_half_and_several_take_the_most_probable():
    one = np.array([0.0, 0.49, 0.5, 0.51, 1.0], dtype=np.float32).reshape(5, 1, 1, 1)
    assert labels_from(one).ravel().tolist() == [0, 0, 1, 1, 1]
    several = np.array(
        [
            [0.7, 0.1, 0.1, 0.1],
            [0.1, 0.6, 0.2, 0.1],
            [0.2, 0.1, 0.4, 0.3],
            [0.0, 0.3, 0.3, 0.4],
            [0.25, 0.35, 0.15, 0.25],
        ],
        dtype=np.float32,
    ).reshape(5, 1, 1, 4)
    labels = labels_from(several)
    assert labels.shape == (5, 1, 1) and labels.dtype == np.uint8
    assert labels.ravel().tolist() == [0, 1, 2, 3, 1]


def by_signs(volume):
    """A stand-in 4-class network, voxel by voxel: background (both channels 0) is class 0; a negative first
    channel class 1; a positive first channel class 2 or 3 by the second channel's sign."""
    first, second = volume[..., 0], volume[..., 1]
    logits = np.stack([1 - 2 * np.abs(first), -first, first - second, first + second - 1], axis=-1).astype(
        np.float32
    )
    exponentials = np.exp(4 * logits)
    return exponentials / exponentials.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("window", [None, (8, 8, 8)])
def test_a_multiclass_predict_writes_each_voxels_most_probable_class(tmp_path, window):
    job = {
        "data": {"channels": [0, 1], "input_shape": [16, 16, 16], "label_mode": "multiclass"},
        "model": {"depth": 2, "base_filters": 4, "output_classes": 4},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(job))
    config = load_config(tmp_path / "config.yaml")
    # Two intensities per channel inside the brain: the z-score makes the lower one negative, the higher
    # positive, whatever their counts. The background (the first three x-slices) is 0 in both channels.
    rng = np.random.default_rng(1)
    shape = (18, 13, 11)
    first = rng.choice(np.array([100, 700], dtype=np.int16), size=shape)
    second = rng.choice(np.array([100, 700], dtype=np.int16), size=shape)
    first[:3], second[:3] = 0, 0
    nib.save(nib.Nifti1Image(np.stack([first, second], axis=-1), np.eye(4)), tmp_path / "case.nii.gz")
    expected = np.zeros(shape, dtype=np.uint8)
    expected[first == 100] = 1
    expected[(first == 700) & (second == 100)] = 2
    expected[(first == 700) & (second == 700)] = 3
    assert set(np.unique(expected)) == {0, 1, 2, 3}

    source = ModelSource(tmp_path / "unused.keras", config, tmp_path / "config.yaml", 2, 4)
    cases = resolve_images([str(tmp_path / "case.nii.gz")])
    plan = plan_volume(config, recorded_layer_table("unet_depth3_filters8_float32"), shape, 2, None, window)
    assert plan.mode == ("whole" if window is None else "tiles")
    out = tmp_path / "out"
    summary = predict(
        PredictRequest(source, cases, out, probabilities=True), plans={"case": plan}, engine=by_signs
    )
    mask = np.asanyarray(nib.load(out / "case.nii.gz").dataobj)
    np.testing.assert_array_equal(mask, expected)
    probabilities = np.asanyarray(nib.load(out / "case_probabilities.nii.gz").dataobj)
    assert probabilities.shape == (*shape, 4)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, atol=1e-5)
    assert probabilities.max(axis=-1).min() > 0.9  # every voxel's class is clear, none a near tie
    assert summary["label_mode"] == "multiclass" and summary["output_classes"] == 4


def test_a_tile_weight_that_underflows_is_raised_to_the_smallest_nonzero_weight():
    # A 256-voxel edge with sigma a twentieth of it (12.8): the edge's outer voxels lie 127.5 / 12.8 = 9.96
    # sigma from the centre, e**-49.6 per axis, e**-148.8 in the corner: below float32's smallest value
    # (1.4e-45 = e**-103.3). Such a voxel would add nothing to its weight sum; where one tile alone covers
    # it, the blend would divide by 0.
    weights = gaussian_weights((256, 256, 256), sigma_scale=1 / 20)
    assert (weights > 0).all()
    exact = np.exp(-0.5 * ((np.arange(256) - 127.5) / 12.8) ** 2)
    assert np.float32(exact[0] ** 3) == 0  # the corner underflows as float32
    raised = weights[0, 0, 0]
    # Raised to the smallest weight that did not underflow, no further: a weight that did not underflow
    # (one axis at its edge, the others beside the centre) is kept as it was, scaled to a maximum of 1
    # (the maximum, exact[127]**3, at the eight voxels around the centre).
    assert raised == weights.min() and np.count_nonzero(weights == raised) > 1
    np.testing.assert_allclose(weights[0, 127, 127], np.float32(exact[0] / exact[127]), rtol=1e-5)
    assert raised < weights[0, 127, 127]


@pytest.mark.parametrize("window", [(16, 16, 16), (24, 12, 16)])
def test_tiles_of_unequal_edges_blend_as_cubic_ones_do(window):
    config, table = small_job()
    shape = (38, 35, 27)
    image = smooth_image(shape, 1)
    expected = box_answer(image)
    tiled = plan_volume(config, table, shape, 1, None, window=window)
    assert tiled.mode == "tiles" and tiled.window == window
    blended = predict_probabilities(box_sigmoid, image, tiled, tta=False)[..., 0]
    assert blended.shape == shape
    error = np.abs(blended - expected)
    assert error.mean() < 0.002, f"mean error {error.mean():.4f}"
    assert dice(blended >= 0.5, expected >= 0.5) >= 0.996


def looks_one_voxel_ahead(volume):
    """A stand-in network that is not mirror-symmetric: a voxel's probability is the sigmoid of its next
    neighbour's value along the first axis (zero past the volume it is given)."""
    ahead = np.zeros_like(volume[0, ..., 0])
    ahead[:-1] = volume[0, 1:, :, :, 0]
    return (1 / (1 + np.exp(-4 * ahead)))[None, ..., None].astype(np.float32)


def test_mirroring_averages_the_network_over_its_eight_flips_whole_and_in_tiles():
    config, table = small_job()
    shape = (38, 35, 27)
    image = smooth_image(shape, 2)
    padded = np.pad(image[..., 0], ((1, 1), (0, 0), (0, 0)))  # zeros on both sides along the first axis

    def sigmoid(values):
        return 1 / (1 + np.exp(-4 * values))

    ahead, behind = sigmoid(padded[2:]), sigmoid(padded[:-2])
    # Flipping the first axis turns "one ahead" into "one behind"; the other flips change nothing. Four of
    # the eight flips include the first axis: the mean is half of each.
    expected = (ahead + behind) / 2
    whole = plan_volume(config, table, shape, 1, None)
    plain = predict_probabilities(looks_one_voxel_ahead, image, whole, tta=False)[..., 0]
    mirrored = predict_probabilities(looks_one_voxel_ahead, image, whole, tta=True)[..., 0]
    np.testing.assert_allclose(plain, ahead, rtol=0, atol=1e-6)
    np.testing.assert_allclose(mirrored, expected, rtol=0, atol=1e-6)
    gap = np.abs(ahead - expected).mean()  # what mirroring changes: 0.13 on this image
    assert gap > 0.05
    tiled = plan_volume(config, table, shape, 1, None, window=(16, 16, 16))
    blended = predict_probabilities(looks_one_voxel_ahead, image, tiled, tta=True)[..., 0]
    # Tiles miss one neighbour at their borders, which their Gaussian weights make small.
    assert np.abs(blended - expected).mean() < gap / 10
