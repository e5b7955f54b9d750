"""Multi-worker validation: every worker must get the same number of full, non-empty batches.

An uneven validation pass (3 cases, global batch 2, 2 workers) used to end in a partial global batch
that MultiWorkerMirroredStrategy split into one sample and one empty batch; the U-Net fails on the
empty one, and the other worker aborts in the next all-reduce (seen in a real two-worker run).
"""

from __future__ import annotations

import numpy as np
import pytest

from bigmem_train.data.pipeline import make_datasets
from bigmem_train.data.reader import check_dataset
from bigmem_train.data.split import split_cases
from tests.unit.nifti_fixtures import phantom, small_config, write_dataset


def centre_sums(config, cases):
    """One number per case that tells the cases apart: the absolute sum of its validation (centre) crop."""
    from bigmem_train.data.prepare import prepare_case

    return [fingerprint(prepare_case(case, config)[0]) for case in cases]


def fingerprint(image) -> float:
    return round(float(np.abs(np.asarray(image)).sum()), 2)


def test_validation_is_whole_global_batches_for_several_workers(tmp_path):
    folder = write_dataset(tmp_path / "d", [phantom(shape=(18, 15, 12), seed=seed) for seed in range(5)])
    config = small_config(folder, channels=[0])
    train_cases, validation_cases = split_cases(check_dataset(config), 0.6, seed=1)  # 2 train, 3 validation
    assert len(validation_cases) == 3
    config.training.batch_size = 2

    single = make_datasets(config, train_cases, validation_cases)
    assert [batch[0].shape[0] for batch in single.validation] == [2, 1]  # one process: unchanged
    assert single.validation_padding == 0

    multi = make_datasets(config, train_cases, validation_cases, workers=2)
    batches = list(multi.validation)
    assert [batch[0].shape[0] for batch in batches] == [2, 2]  # no partial batch left to split
    assert multi.validation_steps == 2 and multi.validation_padding == 1
    seen = [fingerprint(image) for batch in batches for image in batch[0]]
    expected = centre_sums(config, validation_cases)
    assert len(set(expected)) == 3, "the fingerprint tells the cases apart"
    assert seen[:3] == expected, "every validation case, in order"
    assert seen[3] == expected[0], "filled by repeating the first case"
    # The same cases every epoch: a second pass over the finite dataset starts again at the first case.
    again = [fingerprint(image) for batch in multi.validation for image in batch[0]]
    assert again == seen

    config.training.batch_size = 4  # more padding than cases: the pass wraps around as often as needed
    wide = make_datasets(config, train_cases, validation_cases, workers=2)
    assert [batch[0].shape[0] for batch in wide.validation] == [4] and wide.validation_padding == 1
    config.training.batch_size = 2
    even = make_datasets(config, train_cases, validation_cases[:2], workers=2)
    assert even.validation_padding == 0
    assert [fingerprint(image) for batch in even.validation for image in batch[0]] == expected[:2]


def fake_cases(count: int) -> list:
    from pathlib import Path

    from bigmem_train.data.reader import Case

    return [
        Case(f"C{index:02d}", Path(f"i{index}"), Path(f"l{index}"), (16, 16, 12), 1) for index in range(count)
    ]


@pytest.mark.parametrize(
    "train_count, validation_count, batch, expected",
    [
        (9, 3, 2, (8, 4)),  # 3 -> 4 (a tie goes up): one training case moves over
        (10, 5, 4, (11, 4)),  # 5 -> 4 (nearer): one validation case moves back
        (7, 6, 4, (5, 8)),  # 6 -> 8 (a tie goes up)
        (2, 3, 2, (1, 4)),  # 3 -> 4 (a tie goes up), leaving the one training case it must
        (4, 1, 4, (1, 4)),  # less than one batch -> one whole batch, one training case left
        (2, 1, 4, (2, 1)),  # 3 cases, batch 4: no whole batch possible, unchanged (make_datasets pads)
        (3, 2, 4, (1, 4)),  # 2 -> 4 (no whole batch below), one training case left
        (8, 8, 4, (8, 8)),  # already whole batches
        (3, 2, 1, (3, 2)),  # batch 1: nothing to do
        (1, 1, 2, (1, 1)),  # fewer cases than batch + 1: unchanged (make_datasets pads)
        (1, 2, 4, (1, 2)),
    ],
)
def test_balance_split_makes_whole_global_batches(train_count, validation_count, batch, expected):
    from bigmem_train.data.split import balance_split

    cases = fake_cases(train_count + validation_count)
    train, validation = cases[:train_count], cases[train_count:]
    new_train, new_validation = balance_split(train, validation, batch)
    assert (len(new_train), len(new_validation)) == expected
    assert sorted(c.name for c in new_train + new_validation) == [c.name for c in cases], (
        "no case lost or doubled"
    )
    assert not {c.name for c in new_train} & {c.name for c in new_validation}
    if expected != (train_count, validation_count):
        assert len(new_validation) % batch == 0 and len(new_train) >= 1
    assert balance_split(train, validation, batch) == (new_train, new_validation), "deterministic"
