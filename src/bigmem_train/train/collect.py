"""Python's cyclic garbage collector at fixed points of the step (``runtime.python_gc: step``).

The collector normally runs when the count of Python allocations since the last collection passes a
threshold, counted over every thread: the memory sampler's and the callbacks' allocations move it, so it
runs at a different point of the step in every run, and what it frees (arrays and tensors held in reference
cycles) goes back to the allocator in a different order. With the reader on demand and one intra-op
thread, the collector was what still parted a 176x176x128 batch-3 job's runs by 11 %; off as well, three
runs agreed within 0.6 % (docs/design/planner.md, "What parts the runs"). This keeps it, at fixed points: the
objects alive when training starts (the model, TensorFlow's and Keras' own) are frozen out of later
collections, automatic collection is off while ``fit`` runs, and a collection runs at the end of every
training and validation step and every epoch. Opt-in: what it buys at the kit's default reader and threads
is measured in docs/design/planner.md.
"""

from __future__ import annotations

import gc


def collect_at_step_ends_callback():
    """Keras callback: automatic collection off during ``fit``, one collection at each step's end."""
    import keras

    class _CollectAtStepEnds(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._was_enabled = True

        def on_train_begin(self, logs=None):
            gc.collect()
            gc.freeze()
            self._was_enabled = gc.isenabled()
            gc.disable()

        def on_train_batch_end(self, batch, logs=None):
            gc.collect()

        def on_test_batch_end(self, batch, logs=None):
            gc.collect()

        def on_epoch_end(self, epoch, logs=None):
            gc.collect()

        def on_train_end(self, logs=None):
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()

    return _CollectAtStepEnds()
