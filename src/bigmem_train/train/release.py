"""Give the allocator's free pages back to the kernel between epochs.

Validation, checkpoints and TensorBoard run between the last training step of an epoch and the first of
the next, and allocate and free in an order the training step does not. Left alone, tcmalloc keeps the
freed spans mapped, cut to the sizes those phases used, and the next training step, unable to reuse them
for a full-size tensor, maps more: the study's tile at batch 3 (224x224x144) held 19.10 GiB through its
first two epochs and 20.37 GiB from the first step after the second validation on, one full-resolution
batch tensor (1.29 GiB) more; released at every epoch's end, it held 19.62-19.67 GiB. Opt-in
(``runtime.release_between_epochs``): it costs re-faulting the heap in the next epoch's first step, and the
accuracy sweep's 2-12 GiB jobs peaked 3-9 % higher with it (docs/design/planner.md, "Between epochs").
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from bigmem_train.host import preloaded_allocator

# jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena.
_JEMALLOC_ALL_ARENAS = 4096


def release_function(allocator: str | None = None) -> Callable[[], None] | None:
    """A call that hands this process's allocator's free pages back to the kernel, or None where the
    allocator offers none (or is unknown)."""
    allocator = allocator or preloaded_allocator()
    try:
        library = ctypes.CDLL(None)
        if allocator == "tcmalloc":
            release = library.MallocExtension_ReleaseFreeMemory
            release.restype = None
            return release
        if allocator == "jemalloc":
            mallctl = library.mallctl
            name = f"arena.{_JEMALLOC_ALL_ARENAS}.purge".encode()
            return lambda: mallctl(name, None, None, None, ctypes.c_size_t(0))
        if allocator == "glibc":
            trim = library.malloc_trim
            trim.argtypes = [ctypes.c_size_t]
            return lambda: trim(0)
    except AttributeError:
        return None
    return None


def release_callback(release: Callable[[], None] | None = None):
    """Keras callback: ``release`` (default: this process's allocator's) at the end of every epoch, after the
    callbacks before it in the list (validation has run by then; put it after the checkpoints)."""
    import keras

    release = release or release_function()

    class _ReleaseFreeMemory(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if release is not None:
                release()

    return _ReleaseFreeMemory()
