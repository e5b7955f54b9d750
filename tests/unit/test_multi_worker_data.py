"""Multi-worker validation: every worker must get the same number of full, non-empty batches.

An uneven validation pass (3 cases, global batch 2, 2 workers) used to end in a partial global batch
that MultiWorkerMirroredStrategy split into one sample and one empty batch; the U-Net fails on the
empty one, and the other worker aborts in the next all-reduce (seen in a real two-worker run).
"""

from __future__ import annotations

import numpy as np

from bigmem_train.data import check_dataset, make_datasets, split_cases
from tests.unit.nifti_fixtures import phantom, small_config, write_dataset


def centre_sums(config, cases):
    """One number per case that tells the cases apart: the absolute sum of its validation (centre) crop."""
    from bigmem_train.data import prepare_case

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
