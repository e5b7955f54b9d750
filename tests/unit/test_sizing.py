"""Sizing a job to a target (memory/sizing.py) against answers worked out by hand.

The planner is replaced by a stand-in peak (named as such) simple enough to solve on paper: 1000 bytes
plus one byte per voxel of every sample, ``1000 + batch * x * y * z``. The job: input 32x32x16 at batch 2,
depth 2 (edges in steps of 4). Each expected batch and shape below is derived in its comment.
"""

from __future__ import annotations

import math

import pytest

from bigmem_train.config import config_from_dict
from bigmem_train.memory import sizing


def stand_in_peak(config, table, calibration, batch, shape) -> int:
    return 1000 + batch * math.prod(shape)


@pytest.fixture(autouse=True)
def _stand_in(monkeypatch):
    monkeypatch.setattr(sizing, "_peak", stand_in_peak)


def job(resize: str = "both"):
    return config_from_dict(
        {
            "data": {"input_shape": [32, 32, 16]},
            "model": {"depth": 2},
            "training": {"batch_size": 2},
            "footprint": {"resize": resize},
        }
    )


def test_largest_batch_at_the_edges():
    config = job()
    shape = (32, 32, 16)  # 16384 voxels
    assert sizing.largest_batch(config, None, None, shape, 1000 + 5 * 16384) == 5
    assert sizing.largest_batch(config, None, None, shape, 1000 + 5 * 16384 - 1) == 4
    assert sizing.largest_batch(config, None, None, shape, 1000 + 16384) == 1  # batch 1 exactly
    assert sizing.largest_batch(config, None, None, shape, 1000 + 16384 - 1) == 0
    assert sizing.largest_batch(config, None, None, shape, 10**12, ceiling=7) == 7


def test_largest_shape_keeps_the_aspect_then_fills_one_step_at_a_time():
    config = job()
    # At most 8192 voxels at batch 1. Scaled in the 2:2:1 aspect, edges floored to steps of 4: 24x24x12
    # (6912) fits, 28x28x12 (9408) does not. Filling, the axis furthest below its share first (all at
    # 0.75, the first): 28x24x12 (8064) fits; then 28x28x12 (9408), 28x24x16 (10752) and 32x24x12 (9216) do not.
    assert sizing.largest_shape(config, None, None, 1, 1000 + 8192) == (28, 24, 12)
    assert sizing.largest_shape(config, None, None, 1, 1000 + 8192, ceiling=(32, 32, 16)) == (28, 24, 12)
    # A limit of exactly 8064 voxels still takes 28x24x12; one byte less stops at 24x24x12.
    assert sizing.largest_shape(config, None, None, 1, 1000 + 8064) == (28, 24, 12)
    assert sizing.largest_shape(config, None, None, 1, 1000 + 8063) == (24, 24, 12)
    # At most 9216 voxels: from 24x24x12 the first axis grows (28x24x12, 8064), then, furthest below its
    # share, the second (28x28x12, 9408) and the third (28x24x16, 10752) do not fit but the first again does
    # (32x24x12, 9216). Growing the third axis first would give 24x24x16, as many voxels of another shape.
    assert sizing.largest_shape(config, None, None, 1, 1000 + 9216) == (32, 24, 12)
    # Not even 4x4x4 (64 voxels): none.
    assert sizing.largest_shape(config, None, None, 1, 1000 + 63) is None
    # Without a ceiling the shape may grow past the configured one: 64x64x32 at exactly its voxels.
    assert sizing.largest_shape(config, None, None, 1, 1000 + 64 * 64 * 32) == (64, 64, 32)
    # With one, never past it, whatever the limit.
    assert sizing.largest_shape(config, None, None, 1, 10**12, ceiling=(32, 32, 16)) == (32, 32, 16)


def test_resize_batch_keeps_the_shape_and_shape_keeps_the_batch():
    assert sizing.size_to_target(job("batch"), 1000 + 5 * 16384, None, None) == (5, (32, 32, 16))
    assert sizing.size_to_target(job("batch"), 1000, None, None) == (1, (32, 32, 16))  # nothing fits: batch 1
    # Batch 2 kept: at most 8064 voxels a sample, 28x24x12 as above.
    assert sizing.size_to_target(job("shape"), 1000 + 2 * 8064, None, None) == (2, (28, 24, 12))
    # Nothing fits: the smallest shape, one step a side.
    assert sizing.size_to_target(job("shape"), 1000, None, None) == (2, (4, 4, 4))


def test_resize_both_takes_one_batch_more_on_a_smaller_shape_when_it_comes_closer():
    # 60000 B: batch 3 at 32x32x16 peaks at 50152 (batch 4 would be 66536). Batch 4 may use 14750 voxels a
    # sample: scaled 28x28x12 (9408); filling 28x28x16 (12544), 32x28x16 (14336); then 32x32x16 (16384)
    # does not fit and the other axes are at their ceiling. 1000 + 4 x 14336 = 58344, closer to the target.
    assert sizing.size_to_target(job(), 60000, None, None) == (4, (32, 28, 16))


def test_resize_both_keeps_the_configured_shape_on_a_tie():
    # 50252 B: batch 3 at 32x32x16 peaks at 50152. Batch 4 may use 12313 voxels a sample: scaled 28x28x12;
    # filling 32x28x12 (10752), 32x32x12 (12288); 32x32x16 does not fit. 1000 + 4 x 12288 = 50152: a tie,
    # and the configured shape wins it.
    assert sizing.size_to_target(job(), 50252, None, None) == (3, (32, 32, 16))


def test_resize_both_below_batch_one_shrinks_the_shape_at_batch_one():
    # Not even batch 1 at 32x32x16 (17384 B): batch 1 on the largest shape within 8192 voxels, 28x24x12.
    assert sizing.size_to_target(job(), 1000 + 8192, None, None) == (1, (28, 24, 12))
    # Nothing fits at all: the smallest job.
    assert sizing.size_to_target(job(), 1000, None, None) == (1, (4, 4, 4))
