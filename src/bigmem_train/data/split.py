"""The seeded train/validation split and the checks on it: nothing to learn or nothing to score is refused."""

from __future__ import annotations

import numpy as np

from bigmem_train.config import Config
from bigmem_train.data.reader import Case, check_dataset
from bigmem_train.errors import BadInput


def training_split(config: Config, workers: int = 1) -> tuple[list[Case], list[Case]]:
    """Check every case of ``config``'s dataset and split it into (training, validation); with several
    workers the validation set is evened to whole global batches (:func:`balance_split`)."""
    cases = check_dataset(config)
    train, validation = split_cases(cases, config.data.validation_fraction, config.data.split_seed)
    if workers > 1:
        train, validation = balance_split(train, validation, config.training.batch_size)
    check_foreground(train, validation, config)
    return train, validation


def check_foreground(train: list[Case], validation: list[Case], config: Config) -> None:
    """Refuse a split with nothing to learn (no training label has a foreground voxel) or nothing to
    score (no validation label has one inside the centre crop validation reads): Dice is 1.0 for
    predicting nothing on a label that is all background, so such a run would pass its Dice floor
    without having learned anything. Cases not counted (``foreground`` None) are not judged."""
    if train and all(case.foreground == 0 for case in train):
        raise BadInput(
            f"{config.data.path}: none of the {len(train)} training cases' labels has a foreground voxel "
            "(every value is 0): there is nothing to segment; check the label files"
        )
    if validation and all(case.centre_foreground == 0 for case in validation):
        names = ", ".join(case.name for case in validation[:4]) + (", ..." if len(validation) > 4 else "")
        shape = "x".join(str(edge) for edge in config.data.input_shape)
        raise BadInput(
            f"{config.data.path}: no validation case ({names}) has a foreground voxel inside the {shape} "
            "centre crop validation reads, so its Dice would be 1.0 for predicting nothing; change "
            "data.split_seed or data.validation_fraction, or enlarge data.input_shape"
        )


def split_cases(cases: list[Case], validation_fraction: float, seed: int) -> tuple[list[Case], list[Case]]:
    """Seeded split into (training, validation), each non-empty and in the original order."""
    if len(cases) < 2:
        raise BadInput(f"need at least 2 cases to split into training and validation, found {len(cases)}")
    validation_count = min(len(cases) - 1, max(1, round(len(cases) * validation_fraction)))
    order = np.random.default_rng(seed).permutation(len(cases))
    validation = {int(index) for index in order[:validation_count]}
    return (
        [case for index, case in enumerate(cases) if index not in validation],
        [case for index, case in enumerate(cases) if index in validation],
    )


def balance_split(
    train: list[Case], validation: list[Case], global_batch: int
) -> tuple[list[Case], list[Case]]:
    """Move cases between the sets so the validation set is whole global batches (multi-worker).

    MultiWorkerMirroredStrategy splits every validation batch across the workers, and a partial last
    batch would leave some worker an empty one. Rather than repeat cases to fill it (each repeat would
    count twice in the validation metrics), the validation set takes the multiple of ``global_batch``
    nearest its size (a tie goes up), at least one batch, and always leaves one training case: the last
    training cases move to validation, or the last validation cases to training. Deterministic, so every
    worker and every resumed session gets the same split. When no whole batch can be taken (fewer cases
    than ``global_batch`` + 1) the sets are returned as they are and :func:`make_datasets` pads.
    """
    total = len(train) + len(validation)
    if global_batch <= 1 or len(validation) % global_batch == 0 or total < global_batch + 1:
        return train, validation
    below = len(validation) // global_batch * global_batch
    above = below + global_batch
    wanted = above if (len(validation) - below >= above - len(validation) or below == 0) else below
    if total - wanted < 1:
        wanted = below
    if wanted == 0:
        return train, validation
    if wanted > len(validation):
        missing = wanted - len(validation)
        return train[:-missing], validation + train[-missing:]
    surplus = len(validation) - wanted
    return train + validation[-surplus:], validation[:-surplus]
