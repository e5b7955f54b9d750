"""runtime.python_gc: step: the cyclic collector off during fit, run at each step's end."""

from __future__ import annotations

import gc
import weakref

import numpy as np


def test_collector_runs_at_step_ends_only():
    import keras

    from bigmem_train.train.collect import collect_at_step_ends_callback

    seen = {"enabled_in_step": [], "cycle_alive_at_next_step": []}

    class Garbage:
        pass

    class MakeCycles(keras.callbacks.Callback):
        """Before each step: is the last step's cycle gone, is automatic collection off; make a new cycle."""

        ref = None

        def on_train_batch_begin(self, batch, logs=None):
            seen["enabled_in_step"].append(gc.isenabled())
            if self.ref is not None:
                seen["cycle_alive_at_next_step"].append(self.ref() is not None)
            node = Garbage()
            node.self = node  # only the cyclic collector frees this
            self.ref = weakref.ref(node)
            del node

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32")
    gc.enable()
    model.fit(
        x, y, batch_size=2, epochs=1, verbose=0, callbacks=[MakeCycles(), collect_at_step_ends_callback()]
    )
    assert seen["enabled_in_step"] == [False] * 4
    assert seen["cycle_alive_at_next_step"] == [False] * 3  # each collected at its own step's end
    assert gc.isenabled() and not gc.get_freeze_count()  # as it was, once fit ends

    # Without it a cycle can outlive its step: automatic collection, held off here, is all that frees it.
    for values in seen.values():
        values.clear()
    gc.disable()
    try:
        model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[MakeCycles()])
    finally:
        gc.enable()
    assert seen["cycle_alive_at_next_step"] == [True] * 3


def test_python_gc_setting():
    import pytest
    from pydantic import ValidationError

    from bigmem_train.config import Config

    assert Config().runtime.python_gc == "auto"
    assert Config.model_validate({"runtime": {"python_gc": "step"}}).runtime.python_gc == "step"
    with pytest.raises(ValidationError, match="python_gc"):
        Config.model_validate({"runtime": {"python_gc": "never"}})
