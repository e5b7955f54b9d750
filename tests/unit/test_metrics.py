"""The hard Dice metric (model.HardDice): pooled over the epoch, not averaged batch by batch."""

import numpy as np
import pytest

from bigmem_train.model.unet import HardDice


def batch(foreground: list[tuple[slice, ...]], shape=(2, 8, 8, 4)) -> np.ndarray:
    volume = np.zeros((*shape, 1), np.float32)
    for where in foreground:
        volume[where] = 1.0
    return volume


def test_an_all_background_batch_does_not_lift_a_model_that_finds_nothing():
    """Batch-averaged, an empty batch predicted empty scores 1.0 and this model 0.5; pooled, it scores 0."""
    metric = HardDice()
    metric.update_state(batch([]), np.full((2, 8, 8, 4, 1), 0.1, np.float32))  # nothing there, nothing found
    metric.update_state(batch([(0, slice(0, 4))]), np.full((2, 8, 8, 4, 1), 0.1, np.float32))  # missed
    assert float(metric.result()) == pytest.approx(0.0, abs=1e-6)


def test_pooled_dice_counts_every_voxel_once():
    metric = HardDice()
    truth_a, truth_b = batch([(0, slice(0, 2))]), batch([(1, slice(0, 6))])  # 64 and 192 voxels
    prediction_a = np.where(truth_a > 0, 0.9, 0.1).astype(np.float32)  # all 64 found
    prediction_b = np.where(batch([(1, slice(0, 3))]) > 0, 0.9, 0.1).astype(np.float32)  # 96 of 192 found
    metric.update_state(truth_a, prediction_a)
    metric.update_state(truth_b, prediction_b)
    assert float(metric.result()) == pytest.approx(2 * (64 + 96) / (64 + 64 + 192 + 96), rel=1e-6)
    metric.reset_state()
    metric.update_state(truth_b, prediction_b)
    assert float(metric.result()) == pytest.approx(2 * 96 / (192 + 96), rel=1e-6)


def test_multiclass_averages_the_foreground_classes_over_the_pooled_counts():
    labels = np.zeros((1, 4, 4, 2, 1), np.float32)
    labels[0, :2] = 1  # class 1: 16 voxels
    labels[0, 2:, :2] = 2  # class 2: 8 voxels; class 3 absent and never predicted
    scores = np.zeros((1, 4, 4, 2, 4), np.float32)
    scores[..., 0] = 1.0
    scores[0, :2, ..., 1] = 2.0  # class 1 found exactly
    scores[0, 2:, :1, ..., 2] = 2.0  # class 2: 4 of 8 found
    metric = HardDice(classes=4)
    metric.update_state(labels, scores)
    assert float(metric.result()) == pytest.approx((1.0 + 2 * 4 / (8 + 4) + 1.0) / 3, rel=1e-5)
    restored = HardDice.from_config(metric.get_config())
    assert restored.classes == 4 and restored.name == "hard_dice"
