"""The training stage: launch the process (oneDNN, allocator, numactl, threads), the training loop
(``model.fit`` with callbacks), the memory guard and sampler, progress lines and checkpoints.

- :mod:`.launch`       runtime environment, allocator preload, NUMA re-exec, threads
- :mod:`.loop`         :func:`~.loop.train`: callbacks, ``model.fit``, metrics.json
- :mod:`.monitor`      :class:`~.monitor.MemorySampler`, :class:`~.monitor.MemoryProbe`
- :mod:`.guard`        :class:`~.guard.MemoryGuard`: stop at a step boundary before the host runs out
- :mod:`.progress`     what a person watching sees
- :mod:`.checkpoints`  ``.keras`` files written to disk and renamed into place
"""
