"""The data stage: Decathlon reader and checks, the train/validation split, one case prepared as the
network's input (channel choice, crop or pad, normalization: the one code path for training, validation
and prediction), the ``tf.data`` pipelines, and synthetic data.

- :mod:`.reader`    ``dataset.json`` and NIfTI volumes -> checked :class:`~.reader.Case` records
- :mod:`.split`     the seeded train/validation split and its foreground checks
- :mod:`.prepare`   :func:`~.prepare.prepare_case`, :func:`~.prepare.prepare_image` (numpy only)
- :mod:`.pipeline`  :func:`~.pipeline.make_datasets` (TensorFlow imported inside)
- :mod:`.synth`     a synthetic Decathlon-layout dataset

No TensorFlow at import.
"""
