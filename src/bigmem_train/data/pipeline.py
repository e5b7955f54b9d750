"""The ``tf.data`` pipelines of a run: case indices -> shuffle -> parallel map -> batch -> prefetch.

Only indices are shuffled, nothing is cached, so the pipeline holds at most the volumes in flight in the
map plus the batches being built and prefetched. TensorFlow is imported inside :func:`make_datasets`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from bigmem_train.config import Config
from bigmem_train.data.prepare import channel_selection, prepare_case
from bigmem_train.data.reader import Case
from bigmem_train.errors import BadInput


@dataclass
class Datasets:
    """The training (repeats forever) and validation (one finite pass) ``tf.data`` pipelines."""

    train: Any
    validation: Any
    train_steps: int
    validation_steps: int
    channels: int
    # Validation samples repeated to fill the last global batch (multi-worker only; see make_datasets).
    validation_padding: int = 0


def bad_input_from(error: BaseException) -> BadInput | None:
    """Recover the :class:`BadInput` a volume read raised inside ``tf.data`` from TensorFlow's wrapping.

    TensorFlow re-raises it as ``tf.errors.UnknownError`` whose text holds ``BadInput: <path>: ...``;
    this returns that one line as a :class:`BadInput`, or None for any other error.
    """
    text = str(error)
    marker = "BadInput: "
    if isinstance(error, BadInput):
        return error
    if marker not in text:
        return None
    return BadInput(text.split(marker, 1)[1].splitlines()[0].strip())


def make_datasets(
    config: Config, train_cases: list[Case], validation_cases: list[Case], workers: int = 1
) -> Datasets:
    """Build the training and validation ``tf.data`` pipelines and their steps per epoch.

    Training: indices shuffled each epoch (seeded by ``training.seed``), repeated forever, loaded by a
    parallel map (``data.parallel_reads``), batched with the remainder dropped, prefetched. Validation:
    the exact centre of each case, in order, one finite pass, the last batch kept.

    ``workers`` > 1 (MultiWorkerMirroredStrategy; ``training.batch_size`` is the global batch): a
    partial last validation batch would be split into per-worker batches of which some are empty, and
    the U-Net cannot run an empty batch (one worker fails, the others abort in the next all-reduce).
    The run evens the split first (:func:`balance_split`), so this only happens when the dataset has no
    more cases than one global batch: then the validation pass is filled up to whole global batches by
    repeating its first cases (at most ``batch_size - 1`` repeats, the same ones every epoch, counted in
    ``validation_padding``): every worker validates the same number of full batches.
    """
    import tensorflow as tf

    if not train_cases or not validation_cases:
        raise BadInput("make_datasets needs at least one training and one validation case")
    selection = channel_selection(config, train_cases[0].channels)
    channels = len(selection)
    image_shape = (*config.data.input_shape, channels)
    label_shape = (*config.data.input_shape, 1)
    parallel = tf.data.AUTOTUNE if config.data.parallel_reads == "auto" else config.data.parallel_reads
    # parallel_reads 0: a plain map, run by whoever asks for the next element (the training step).
    map_options = {"num_parallel_calls": parallel, "deterministic": True} if parallel else {}
    batch_size = config.training.batch_size
    seed = config.training.seed

    def loader(cases: list[Case], training: bool):
        def load(index, sample):
            rng = np.random.default_rng([seed, int(sample)]) if training else None
            return prepare_case(cases[int(index)], config, rng)

        def load_tensors(index, sample):
            image, label = tf.numpy_function(load, [index, sample], [tf.float32, tf.float32], stateful=False)
            image.set_shape(image_shape)
            label.set_shape(label_shape)
            return image, label

        return load_tensors

    load_train = loader(list(train_cases), training=True)
    load_validation = loader(list(validation_cases), training=False)

    def map_train(sample, index):
        return load_train(index, sample)

    def map_validation(index):
        return load_validation(index, index)

    train = (
        tf.data.Dataset.range(len(train_cases))
        .shuffle(len(train_cases), seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .enumerate()  # a running sample number seeds each sample's crop and flips
        .map(map_train, **map_options)
        .batch(batch_size, drop_remainder=True)
    )
    validation_indices = np.arange(len(validation_cases), dtype=np.int64)
    if workers > 1:
        whole_batches = math.ceil(len(validation_cases) / batch_size) * batch_size
        validation_indices = np.resize(validation_indices, whole_batches)  # repeats from the start
    validation_padding = len(validation_indices) - len(validation_cases)
    validation = (
        tf.data.Dataset.from_tensor_slices(validation_indices)
        .map(map_validation, **map_options)
        .batch(batch_size, drop_remainder=workers > 1)
    )
    if not parallel:
        # In the step means on demand. tf.data's default rewrites would still read ahead in their own
        # threads: map + batch fused into one op with a runner thread, and, with autotuning, a prefetch
        # injected after a synchronous batch (1-2 batches read ahead, measured). Both off here.
        options = tf.data.Options()
        options.autotune.enabled = False
        options.experimental_optimization.map_and_batch_fusion = False
        options.experimental_optimization.inject_prefetch = False
        train = train.with_options(options)
        validation = validation.with_options(options)
    if config.data.prefetch_batches:
        train = train.prefetch(config.data.prefetch_batches)
        validation = validation.prefetch(config.data.prefetch_batches)

    train_steps = config.training.steps_per_epoch or max(1, len(train_cases) // batch_size)
    validation_batches = math.ceil(len(validation_indices) / batch_size)
    validation_steps = min(config.training.validation_steps or validation_batches, validation_batches)
    return Datasets(train, validation, train_steps, validation_steps, channels, validation_padding)
