"""Model checkpoints (``last.keras``, ``best.keras``) written without staging the file in memory.

Keras' own ``.keras`` writer builds the archive's ``model.weights.h5`` in an ``io.BytesIO`` that grows as
HDF5 writes into it, then copies it into the zip (``H5IOStore.close``: ``writestr(..., getvalue())``): for
a model of P float32 parameters with Adam that is about 3 x P x 4 B staged, grown by reallocation, plus
its copy, twice an epoch (last and best). Those buffers are freed again, but the allocator's heap keeps
them, and where they lie decides how much of it the next training step can reuse: the same job's peak
then varies from one process to the next. Measured (docs/design/planner.md, ``benchmarks/checkpoint_spread.py``):
a 12.7 M-parameter job (64x48x48, batch 2, 24 filters, depth 4) peaked at 1.48-1.75 GiB in five runs with
Keras' writer and at 1.34-1.37 GiB in five alternating runs with this one, at the same step time.

Here Keras writes the model unzipped into a temporary directory next to the target (HDF5 writes each
variable to the file as it goes), the directory is zipped into ``<name>.partial`` in 8 KiB pieces
(``zipfile.ZipFile.write``) and renamed over the target: the same archive ``keras.models.load_model``
reads, and a run killed while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

# For benchmarks/checkpoint_spread.py only: "keras" makes the checkpoints use Keras' own writer again, so
# the two can be measured side by side.
WRITER_ENVIRONMENT = "BIGMEM_CHECKPOINT_WRITER"


def save_model_file(model, path: Path) -> None:
    """Write ``model`` (architecture, weights, optimizer state) to the ``.keras`` file ``path``."""
    path = Path(path)
    if path.suffix != ".keras":
        raise ValueError(f"a model checkpoint is a .keras file, not {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*"):  # what a save killed midway left behind
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    unzipped = staging / "model"

    def write_archive(partial: Path) -> None:
        with zipfile.ZipFile(partial, "w") as archive:  # stored, not deflated, as Keras writes it
            for member in sorted(unzipped.rglob("*")):
                if member.is_file():
                    archive.write(member, member.relative_to(unzipped).as_posix())

    try:
        model.save(str(unzipped), zipped=False)
        _replace_with(path, write_archive, partial=path.with_name(f".{path.name}.partial"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def model_checkpoint(filepath: Path, **options):
    """``keras.callbacks.ModelCheckpoint`` (its schedule, monitor and best-only logic) whose saves go
    through :func:`save_model_file`."""
    import keras

    class StreamedModelCheckpoint(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch, batch, logs):
            filepath = self._get_file_path(epoch, batch, logs)
            if self._should_save_model(epoch, batch, logs, filepath):
                save_model_file(self.model, Path(filepath))

    if os.environ.get(WRITER_ENVIRONMENT) == "keras":
        return keras.callbacks.ModelCheckpoint(str(filepath), **options)
    if options.get("save_weights_only"):
        raise ValueError("model_checkpoint writes whole models; use ModelCheckpoint for weights only")
    for method in ("_save_model", "_get_file_path", "_should_save_model"):
        if not hasattr(keras.callbacks.ModelCheckpoint, method):  # a Keras that no longer has the hook
            raise RuntimeError(f"keras.callbacks.ModelCheckpoint has no {method}: update checkpoints.py")
    return StreamedModelCheckpoint(str(filepath), **options)


def backup_and_restore(backup_dir: Path, **options):
    """``keras.callbacks.BackupAndRestore`` (a killed run resumes at its last finished epoch) whose backup
    survives a kill at any instant.

    Keras writes ``latest.weights.h5`` and ``training_metadata.json`` in place: a run killed while it
    wrote them leaves a half-written file. With ``double_checkpoint`` Keras falls back to the previous
    epoch's pair, but only when loading raises ``OSError``, and an emptied metadata file raises
    ``JSONDecodeError`` (a resume crashed on one in CI, stop 28). Here each file of the backup is written
    beside its target and renamed over it, so a reader sees the old file or the new one, never half of
    one; and a metadata file that cannot be read (an earlier writer's) is an ``OSError``, so Keras'
    fallback to the previous epoch applies to it too.
    """
    import json

    import keras

    class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
        def _save_model(self):
            Path(self.backup_dir).mkdir(parents=True, exist_ok=True)
            weights, metadata = Path(self._weights_path), Path(self._training_metadata_path)
            if self.double_checkpoint:
                for source, target in (
                    (weights, Path(self._prev_weights_path)),
                    (metadata, Path(self._prev_training_metadata_path)),
                ):
                    if source.exists():
                        _replace_with(target, lambda partial, source=source: shutil.copyfile(source, partial))
            # The partial weights keep the .weights.h5 ending save_weights insists on.
            _replace_with(
                weights,
                lambda partial: self.model.save_weights(str(partial), overwrite=True),
                partial=weights.with_name(f".partial.{weights.name}"),
            )
            state = {"epoch": self._current_epoch, "batch": self._last_batch_seen}
            _replace_with(metadata, lambda partial: partial.write_text(json.dumps(state)))

        def _load_model(self):
            metadata = Path(self._training_metadata_path)
            if metadata.exists():
                try:
                    json.loads(metadata.read_text())["epoch"]
                except (ValueError, KeyError, TypeError) as error:
                    raise OSError(f"{metadata}: unreadable training state ({error})") from error
            super()._load_model()

    for method in ("_save_model", "_load_model"):
        if not hasattr(keras.callbacks.BackupAndRestore, method):  # a Keras that no longer has the hook
            raise RuntimeError(f"keras.callbacks.BackupAndRestore has no {method}: update checkpoints.py")
    return AtomicBackupAndRestore(str(backup_dir), **options)


def _replace_with(target: Path, write, partial: Path | None = None) -> None:
    """Write ``target`` through ``write(partial)`` and rename the partial file over it; a failed write
    leaves ``target`` as it was and removes the partial file."""
    partial = partial or target.with_name(f".partial.{target.name}")
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
