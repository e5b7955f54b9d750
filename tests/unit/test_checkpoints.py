"""Model checkpoints streamed to disk (checkpoints.py): the same archive Keras writes and reads, the best-only
schedule of ModelCheckpoint, and a failed save that leaves the previous checkpoint whole."""

import json
import zipfile

import numpy as np
import pytest

from bigmem_train.train.checkpoints import (
    WRITER_ENVIRONMENT,
    backup_and_restore,
    model_checkpoint,
    save_model_file,
)


def trained_model():
    """A small Conv3D model with Adam's slots filled by one step, as a checkpoint finds it."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 4, 1))
    hidden = keras.layers.Conv3D(4, 3, padding="same", activation="relu", name="conv")(inputs)
    outputs = keras.layers.Conv3D(1, 1, activation="sigmoid", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 4, 1)).astype(np.float32)
    model.fit(x, (x > 0).astype(np.float32), epochs=1, verbose=0)
    return model, x


def test_streamed_file_is_the_archive_keras_writes_and_loads(tmp_path):
    import keras

    model, x = trained_model()
    path = tmp_path / "last.keras"
    save_model_file(model, path)
    model.save(tmp_path / "keras.keras")

    with zipfile.ZipFile(path) as ours, zipfile.ZipFile(tmp_path / "keras.keras") as theirs:
        assert sorted(ours.namelist()) == sorted(n for n in theirs.namelist() if not n.endswith("/"))
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert {p.name for p in tmp_path.iterdir()} == {"last.keras", "keras.keras"}  # nothing staged is left


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    model, _ = trained_model()
    path = tmp_path / "last.keras"
    save_model_file(model, path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save", fail)
    with pytest.raises(OSError, match="disk full"):
        save_model_file(model, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.keras"]


def test_what_a_killed_save_left_is_cleared_by_the_next(tmp_path):
    model, _ = trained_model()
    (tmp_path / ".last.keras.k1ll3d" / "model").mkdir(parents=True)
    (tmp_path / ".last.keras.partial").write_bytes(b"half a zip")
    (tmp_path / ".best.keras.other").mkdir()  # another checkpoint's: not this save's to clear
    save_model_file(model, tmp_path / "last.keras")
    assert {p.name for p in tmp_path.iterdir()} == {"last.keras", ".best.keras.other"}


def test_best_only_saves_on_improvement_only(tmp_path):
    model, _ = trained_model()
    path = tmp_path / "best.keras"
    callback = model_checkpoint(path, monitor="val_dice", mode="max", save_best_only=True)
    callback.set_model(model)

    callback.on_epoch_end(0, {"val_dice": 0.5})
    assert path.is_file()
    first = path.stat().st_mtime_ns
    path.write_bytes(b"marker")  # a save would replace it
    callback.on_epoch_end(1, {"val_dice": 0.4})
    assert path.read_bytes() == b"marker"
    callback.on_epoch_end(2, {"val_dice": 0.6})
    assert zipfile.is_zipfile(path) and path.stat().st_mtime_ns >= first


def test_keras_writer_is_kept_for_the_side_by_side_benchmark(tmp_path, monkeypatch):
    import keras

    monkeypatch.setenv(WRITER_ENVIRONMENT, "keras")
    callback = model_checkpoint(tmp_path / "last.keras")
    assert type(callback) is keras.callbacks.ModelCheckpoint


def test_refuses_what_is_not_a_keras_file(tmp_path):
    model, _ = trained_model()
    with pytest.raises(ValueError, match="weights.h5"):
        save_model_file(model, tmp_path / "model.weights.h5")


def fit_with_backup(model, x, backup_dir, epochs, stop_after=None):
    """Fit ``model`` for ``epochs`` with the kit's backup; ``stop_after`` epochs ends the process's share of
    the run there, as a kill would (the backup is kept: delete_checkpoint only acts on a finished run)."""
    import keras

    class Kill(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if stop_after is not None and epoch + 1 == stop_after:
                raise KeyboardInterrupt

    backup = backup_and_restore(backup_dir, save_freq="epoch", delete_checkpoint=True, double_checkpoint=True)
    started = []

    class Start(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            started.append(epoch)

    try:
        model.fit(
            x, (x > 0).astype(np.float32), epochs=epochs, verbose=0, callbacks=[backup, Start(), Kill()]
        )
    except KeyboardInterrupt:
        pass
    return started


def test_backup_files_are_whole_after_each_epoch_and_nothing_partial_is_left(tmp_path):
    import keras

    model, x = trained_model()
    backup = tmp_path / "backup"
    fit_with_backup(model, x, backup, epochs=5, stop_after=3)
    assert sorted(p.name for p in backup.iterdir()) == [
        "latest.weights.h5",
        "latest.weights.h5.bkp",
        "training_metadata.json",
        "training_metadata.json.bkp",
    ]
    assert json.loads((backup / "training_metadata.json").read_text())["epoch"] == 3
    assert json.loads((backup / "training_metadata.json.bkp").read_text())["epoch"] == 2
    restored = keras.models.clone_model(model)
    restored.load_weights(backup / "latest.weights.h5")
    np.testing.assert_array_equal(restored.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize("metadata", ["", '{"epo', '{"batch": 0}'])
def test_a_kill_mid_metadata_resumes_from_the_previous_epoch(tmp_path, metadata):
    model, x = trained_model()
    backup = tmp_path / "backup"
    fit_with_backup(model, x, backup, epochs=5, stop_after=3)
    # What Keras' own in-place writer leaves when killed between truncating the file and writing it.
    (backup / "training_metadata.json").write_text(metadata)
    started = fit_with_backup(model, x, backup, epochs=5)
    assert started == [2, 3, 4]  # the previous epoch's pair, not a crash and not a restart
    assert not backup.exists()  # the finished run removes its backup


def test_a_failed_backup_write_keeps_the_last_whole_backup(tmp_path, monkeypatch):
    model, x = trained_model()
    backup = tmp_path / "backup"
    fit_with_backup(model, x, backup, epochs=5, stop_after=2)
    before = {p.name: p.read_bytes() for p in backup.iterdir()}

    def fail(self, filepath, *args, **kwargs):
        with open(filepath, "wb") as half:  # the disk fills midway through the file
            half.write(b"\x89HDF\r\n")
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_weights", fail)
    with pytest.raises(OSError, match="disk full"):
        fit_with_backup(model, x, backup, epochs=5)
    after = {p.name: p.read_bytes() for p in backup.iterdir()}
    assert after["latest.weights.h5"] == before["latest.weights.h5"]
    assert json.loads(after["training_metadata.json"])["epoch"] == 2
    assert not [name for name in after if name.startswith(".partial")]
