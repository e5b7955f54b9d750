"""predict and evaluate refuse what a user can get wrong: exit 2 and one line naming the problem (exit 3 only
for what does not fit: a full output filesystem), before the model loads or a case is scored, and nothing
half-written left behind.

Two tiny untrained U-Nets stand in for trained ones (only their saved configs and the images' shapes
matter here); where a test must get as far as writing, ``pointwise`` stands in for the engine (the model is
never loaded) and ``full_disk`` for a filesystem that fills (one test fills a real tmpfs where mounting is
permitted).
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import subprocess
import zipfile

import nibabel as nib
import numpy as np
import pytest
import yaml

from bigmem_train.cli import main

FOUR_CHANNELS = {  # the MSD Task01 contrasts, "all": the model reads exactly four
    "data": {"channels": "all", "input_shape": [16, 16, 16], "label_mode": "binary"},
    "model": {"depth": 2, "base_filters": 4},
}
FLAIR = {  # the study's channel and classes, but depth 3 and 4 filters (the study: 4 and 16)
    "data": {"channels": [0], "input_shape": [16, 16, 16], "label_mode": "binary"},
    "model": {"depth": 3, "base_filters": 4},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories as `train` leaves them (config.yaml, checkpoints/best.keras), untrained."""
    pytest.importorskip("tensorflow")
    from bigmem_train.config import load_config
    from bigmem_train.model.unet import build_unet

    folders = {}
    for name, job in {"four": FOUR_CHANNELS, "flair": FLAIR}.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.yaml").write_text(yaml.safe_dump(job))
        config = load_config(folder / "config.yaml")
        model = build_unet(config.model, tuple(config.data.input_shape), config.num_channels)
        (folder / "checkpoints").mkdir()
        model.save(folder / "checkpoints" / "best.keras")
        folders[name] = folder
    return folders


def pointwise(volume):
    """A stand-in engine: each voxel's probability from its first channel alone."""
    return 1 / (1 + np.exp(-volume[..., :1]))


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    """The engine is the stand-in everywhere: no test here needs a model's answers, and a refused input
    never gets as far as loading one."""
    import bigmem_train.infer.predict as predict_module

    monkeypatch.setattr(predict_module, "make_engine", lambda *args, **kwargs: pointwise)


def _image(path, shape=(16, 16, 12), channels=1, dtype=np.int16, data=None, seed=0):
    if data is None:
        data = np.random.default_rng(seed).integers(0, 800, size=(*shape, channels)).astype(dtype)
        data = data[..., 0] if channels == 1 else data
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.diag([1.0, 1.0, 2.0, 1.0])), path)
    return path


def _predict(run, images, out, *flags):
    return main(["predict", "--model", str(run), "--data", *map(str, images), "--out", str(out), *flags])


def _one_line(capsys, *needles) -> str:
    """stderr is one line, the CLI's error, and names each of ``needles``."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bigmem-train: error: "), err
    for needle in needles:
        assert str(needle) in err, err
    return err


def _nothing_written(out):
    """No mask, no probabilities, no partial file (a refused predict may leave the empty --out or its
    predict.json, which are whole)."""
    if out.exists():
        left = sorted(path.name for path in out.iterdir() if path.name != "predict.json")
        assert not left, left


# --- predict: the images ---------------------------------------------------------------------------


@pytest.mark.parametrize("channels, message", [(1, "has 1 channel(s)"), (5, "has 5 channel(s)")])
def test_an_image_without_the_models_channels(runs, tmp_path, capsys, channels, message):
    image = _image(tmp_path / "in" / "a.nii.gz", channels=channels)
    assert _predict(runs["four"], [image], tmp_path / "out") == 2
    _one_line(capsys, image, message, "data.channels 'all' reads 4")
    _nothing_written(tmp_path / "out")


def _claims_more(path, shape=(400, 400, 300)):
    """A NIfTI file whose header announces a far larger volume than the data the file holds."""
    small = _image(path.with_name("small.nii"), seed=1)
    raw = small.read_bytes()
    header = nib.load(small).header.copy()
    header.set_data_shape(shape)
    blob = header.binaryblock + raw[len(header.binaryblock) :]
    path.write_bytes(gzip.compress(blob) if path.name.endswith(".gz") else blob)
    small.unlink()
    return path


@pytest.mark.parametrize("name", ["big.nii", "big.nii.gz"])
def test_a_header_that_claims_more_than_its_file_is_truncated_not_too_big(runs, tmp_path, capsys, name):
    image = _claims_more(tmp_path / "in" / name)
    assert _predict(runs["flair"], [image], tmp_path / "out") == 2
    _one_line(capsys, image, "truncated")
    _nothing_written(tmp_path / "out")


def test_a_truncated_file_that_would_not_fit_is_still_bad_input(runs, tmp_path, capsys):
    # Big enough a file that its size alone cannot tell, a header too big to plan: the file is checked
    # before "does not fit" is said.
    image = tmp_path / "in" / "big.nii.gz"
    _image(image, shape=(64, 64, 64), seed=2)
    blob = bytearray(gzip.decompress(image.read_bytes()))
    header = nib.load(image).header.copy()
    header.set_data_shape((512, 512, 512))  # 256 MiB: a 0.5 MiB gzip file could hold that
    blob[: len(header.binaryblock)] = header.binaryblock
    image.write_bytes(gzip.compress(bytes(blob), compresslevel=0))
    assert _predict(runs["flair"], [image], tmp_path / "out", "--target", "64MiB") == 2
    _one_line(capsys, image, "truncated: 524640 bytes of data, the header needs 2684")


def _cut_in_half(path):
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])


def _flip_bytes(path):
    content = bytearray(path.read_bytes())
    middle = len(content) // 2
    content[middle : middle + 64] = bytes(255 - byte for byte in content[middle : middle + 64])
    path.write_bytes(bytes(content))


def _nan(path):
    data = np.random.default_rng(3).standard_normal((16, 16, 12)).astype(np.float32)
    data[4, 5, 6] = np.nan
    _image(path, data=data)


def _complex(path):
    _image(path, data=np.ones((16, 16, 12), np.complex64))


@pytest.mark.parametrize(
    "breakage, message",
    [
        (_cut_in_half, "corrupt or truncated gzip stream"),
        (_flip_bytes, "corrupt or truncated gzip stream"),
        (_nan, "1 of 3072 voxel values are NaN or infinite"),
        (_complex, "is not a real number type"),
        (lambda path: path.write_bytes(b""), "not a readable NIfTI file"),
        (lambda path: path.write_text("not an image\n"), "not a readable NIfTI file"),
        (lambda path: path.write_bytes(gzip.compress(b"not an image" * 100)), "not a readable NIfTI file"),
        (lambda path: _image(path, data=np.ones((16, 16), np.int16)), "image is 2D"),
        (lambda path: _image(path, data=np.ones((16, 0, 12), np.int16)), "has an empty axis"),
    ],
    ids=["truncated", "corrupt", "nan", "complex", "empty", "text", "gzip-of-text", "2d", "empty-axis"],
)
def test_a_broken_image_is_refused_before_the_model_loads(runs, tmp_path, capsys, breakage, message):
    good = _image(tmp_path / "in" / "a_good.nii.gz", seed=4)
    bad = tmp_path / "in" / "b_bad.nii.gz"
    _image(bad, seed=5)
    breakage(bad)
    assert _predict(runs["flair"], [tmp_path / "in"], tmp_path / "out") == 2
    _one_line(capsys, bad, message)
    # Not even the good case is written: every image is checked before the first is predicted.
    _nothing_written(tmp_path / "out")
    assert good.exists()


def _data(kind, tmp_path):
    """What ``--data`` names for each way of naming no image."""
    if kind == "missing":
        return tmp_path / "missing.nii.gz"
    if kind == "not-nifti":
        (tmp_path / "notes.txt").write_text("x")
        return tmp_path / "notes.txt"
    folder = tmp_path / "data"
    folder.mkdir()
    if kind == "bad-dataset-json":
        (folder / "dataset.json").write_text("{")
    elif kind == "listed-missing":
        (folder / "dataset.json").write_text(json.dumps({"test": ["imagesTs/x.nii.gz"]}))
    elif kind == "only-other-files":
        (folder / "a.nii.gz.bak").write_text("x")
        (folder / "sub.nii.gz").mkdir()
    return folder


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "missing.nii.gz: does not exist"),
        ("not-nifti", "notes.txt: not a NIfTI image"),
        ("empty-folder", "a folder without .nii or .nii.gz images"),
        ("only-other-files", "a folder without .nii or .nii.gz images"),
        ("bad-dataset-json", "dataset.json: cannot be read (Expecting property name"),
        ("listed-missing", "imagesTs/x.nii.gz: listed but does not exist"),
    ],
)
def test_data_that_names_no_image(runs, tmp_path, capsys, kind, message):
    assert _predict(runs["flair"], [_data(kind, tmp_path)], tmp_path / "out") == 2
    _one_line(capsys, message)
    assert not (tmp_path / "out").exists()


# --- predict: the model and its config -------------------------------------------------------------


def test_a_config_of_another_network_is_refused_naming_both(runs, tmp_path, capsys):
    model = runs["flair"] / "checkpoints" / "best.keras"
    image = _image(tmp_path / "a.nii.gz")
    assert _predict(model, [image], tmp_path / "out", "--config", "study", "--plan") == 2
    _one_line(capsys, model, "--config study", "depth 3 and 4 base filters", "depth 4 and 16")


def test_a_config_whose_channels_differ_from_the_model(runs, tmp_path, capsys):
    config = tmp_path / "four.yaml"
    config.write_text(yaml.safe_dump({**FLAIR, "data": {**FLAIR["data"], "channels": [0, 1, 2, 3]}}))
    model = runs["flair"] / "checkpoints" / "best.keras"
    image = _image(tmp_path / "a.nii.gz", channels=4)
    assert _predict(model, [image], tmp_path / "out", "--config", str(config)) == 2
    _one_line(capsys, "the model reads 1 channel(s)", f"--config {config} says 4 channel(s)")


def _foreign_keras(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("config.json", json.dumps({"class_name": "Sequential", "config": {"layers": []}}))


@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("missing.keras", [], "--model {tmp}/missing.keras: does not exist"),
        (
            "run",
            ["--config", "{tmp}/nope.yaml"],
            "--config {tmp}/nope.yaml: config file {tmp}/nope.yaml does not exist",
        ),
        (
            "run",
            ["--config", "{tmp}/bad.yaml"],
            "--config {tmp}/bad.yaml: config file {tmp}/bad.yaml is not valid YAML",
        ),
        ("text.keras", ["--config", "{run}/config.yaml"], "not a Keras model file"),
        ("foreign.keras", ["--config", "{run}/config.yaml"], "not one of the kit's U-Nets"),
        ("loose.keras", [], "no config.yaml of the run it was trained in"),
        ("empty-run", [], "a folder without checkpoints/best.keras"),
    ],
    ids=["missing-model", "missing-config", "bad-yaml", "not-a-zip", "foreign", "no-config", "no-checkpoint"],
)
def test_a_model_that_cannot_be_used(runs, tmp_path, capsys, model, extra, message):
    run = runs["flair"]
    (tmp_path / "bad.yaml").write_text("data: [unclosed\n")
    (tmp_path / "text.keras").write_text("not a zip")
    _foreign_keras(tmp_path / "foreign.keras")
    (tmp_path / "loose.keras").write_bytes((run / "checkpoints" / "best.keras").read_bytes())
    (tmp_path / "empty-run").mkdir()
    model_path = run if model == "run" else tmp_path / model
    extra = [flag.format(tmp=tmp_path, run=run) for flag in extra]
    image = _image(tmp_path / "in" / "a.nii.gz")
    assert _predict(model_path, [image], tmp_path / "out", *extra) == 2
    _one_line(capsys, message.format(tmp=tmp_path))
    assert not (tmp_path / "out").exists()


# --- predict: flags and outputs --------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tile", "abc"], "--tile abc: give three positive edges"),
        (["--tile", "0,16,16"], "--tile 0,16,16: give three positive edges"),
        (["--tile", "16,16"], "--tile 16,16: give three positive edges"),
        (["--target", "lots"], "--target lots: size 'lots' is not a size"),
        (["--target", "0"], "--target 0: give a size above 0"),
        (["--target", "0%"], "--target 0%"),
        (["--subset", "training"], "lists no 'training' images"),
    ],
)
def test_flags_that_make_no_sense(runs, tmp_path, capsys, flags, message):
    (tmp_path / "dec" / "imagesTs").mkdir(parents=True)
    _image(tmp_path / "dec" / "imagesTs" / "a.nii.gz")
    (tmp_path / "dec" / "dataset.json").write_text(json.dumps({"test": ["imagesTs/a.nii.gz"]}))
    assert _predict(runs["flair"], [tmp_path / "dec"], tmp_path / "out", *flags) == 2
    _one_line(capsys, message)
    _nothing_written(tmp_path / "out")


def test_out_in_the_images_folder_is_refused(runs, tmp_path, capsys):
    image = _image(tmp_path / "in" / "a.nii.gz")
    assert _predict(runs["flair"], [tmp_path / "in"], tmp_path / "in") == 2
    _one_line(capsys, f"--out {tmp_path / 'in'}: is the folder of the image {image}")
    assert sorted(path.name for path in (tmp_path / "in").iterdir()) == ["a.nii.gz"]


def test_out_that_is_a_file_or_under_one(runs, tmp_path, capsys):
    image = _image(tmp_path / "in" / "a.nii.gz")
    (tmp_path / "file").write_text("a file")
    assert _predict(runs["flair"], [image], tmp_path / "file") == 2
    _one_line(capsys, f"--out {tmp_path / 'file'}: is a file, not a folder")
    assert _predict(runs["flair"], [image], tmp_path / "file" / "masks") == 2
    _one_line(capsys, f"--out {tmp_path / 'file' / 'masks'}: cannot be written")


def test_probabilities_that_would_overwrite_another_cases_mask(runs, tmp_path, capsys):
    _image(tmp_path / "in" / "a.nii.gz")
    other = _image(tmp_path / "in" / "a_probabilities.nii.gz", seed=1)
    assert _predict(runs["flair"], [tmp_path / "in"], tmp_path / "out", "--probabilities") == 2
    _one_line(capsys, "its probabilities would be written over the mask of", other)
    _nothing_written(tmp_path / "out")


def full_disk(fail_on):
    """A stand-in for nibabel's save on a filesystem that fills: half the file, then ENOSPC, for the
    outputs whose name contains ``fail_on``."""
    real_save = nib.save

    def save(image, path):
        if fail_on not in str(path):
            return real_save(image, path)
        real_save(image, path)
        with open(path, "r+b") as file:
            file.truncate(file.seek(0, 2) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return save


def _error_line(capsys, *needles) -> str:
    """A run that stops midway printed its progress first: its last line is the one error, no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err
    assert lines[-1].startswith("bigmem-train: error: "), err
    for needle in needles:
        assert str(needle) in lines[-1], err
    return lines[-1]


@pytest.mark.parametrize("fail_on", ["_probabilities", "a.nii.gz"])
def test_a_full_output_filesystem_is_exit_3_and_leaves_no_partial_file(
    runs, tmp_path, capsys, monkeypatch, fail_on
):
    import bigmem_train.infer.nifti as nifti

    image = _image(tmp_path / "in" / "a.nii.gz")
    monkeypatch.setattr(nifti.nib, "save", full_disk(fail_on))
    assert _predict(runs["flair"], [image], tmp_path / "out", "--probabilities") == 3
    _error_line(capsys, "the output filesystem is full", tmp_path / "out")
    # Neither the half-written file nor the other output of the case: a rerun predicts it again.
    _nothing_written(tmp_path / "out")


def test_another_write_error_is_exit_2(runs, tmp_path, capsys, monkeypatch):
    import bigmem_train.infer.nifti as nifti

    def read_only(image, path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    image = _image(tmp_path / "in" / "a.nii.gz")
    monkeypatch.setattr(nifti.nib, "save", read_only)
    assert _predict(runs["flair"], [image], tmp_path / "out") == 2
    _error_line(capsys, tmp_path / "out" / "a.nii.gz", "cannot be written (Read-only file system)")
    _nothing_written(tmp_path / "out")


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real 16 KiB tmpfs, where this process may mount one (root, a permissive container)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"mount not permitted here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_a_real_full_filesystem(runs, tmp_path, capsys, tiny_filesystem):
    image = _image(tmp_path / "in" / "a.nii.gz", shape=(48, 48, 32))
    out = tiny_filesystem / "out"
    assert _predict(runs["flair"], [image], out, "--probabilities") == 3
    _error_line(capsys, "the output filesystem is full", out)
    _nothing_written(out)


# --- evaluate --------------------------------------------------------------------------------------


def _mask(path, data=None, zooms=(1.0, 1.0, 2.0)):
    if data is None:
        data = np.zeros((12, 12, 8), np.uint8)
        data[3:7, 4:8, 2:5] = 1
    image = nib.Nifti1Image(np.asarray(data), np.diag([*zooms, 1.0]))
    image.header.set_zooms((*zooms, *image.header.get_zooms()[3:]))
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(image, path)
    return path


@pytest.fixture
def folders(tmp_path):
    for name in ("case_0", "case_1"):
        _mask(tmp_path / "pred" / f"{name}.nii.gz")
        _mask(tmp_path / "labels" / f"{name}.nii.gz")
    return tmp_path / "pred", tmp_path / "labels"


def _evaluate(pred, labels, out=None):
    return main(
        ["evaluate", "--pred", str(pred), "--labels", str(labels), *(["--out", str(out)] if out else [])]
    )


def _no_results(*folders):
    for folder in folders:
        if folder.exists():
            left = [
                path.name for path in folder.iterdir() if path.name.startswith((".partial", "evaluation"))
            ]
            assert not left, left


def test_evaluate_out_naming_an_existing_file(folders, tmp_path, capsys):
    pred, labels = folders
    (tmp_path / "results.txt").write_text("keep me")
    assert _evaluate(pred, labels, tmp_path / "results.txt") == 2
    _one_line(capsys, f"--out {tmp_path / 'results.txt'}: is a file, not a folder")
    assert (tmp_path / "results.txt").read_text() == "keep me"
    assert _evaluate(pred, labels, tmp_path / "results.txt" / "sub") == 2
    _one_line(capsys, f"--out {tmp_path / 'results.txt' / 'sub'}", "is a file, not a folder")
    _no_results(pred)


def _label(name, data, **kwargs):
    return lambda pred, labels: _mask(labels / name, np.asarray(data), **kwargs)


def _fractional(pred, labels):
    data = np.zeros((12, 12, 8), np.float32)
    data[3:7, 4:8, 2:5] = 0.6
    _mask(labels / "case_1.nii.gz", data)


def _nan_mask(pred, labels):
    data = np.zeros((12, 12, 8), np.float32)
    data[1, 1, 1] = np.nan
    _mask(pred / "case_0.nii.gz", data)


def _rename_labels(pred, labels):
    for path in labels.iterdir():
        path.rename(labels / f"BRATS_{path.name}")


def _labels_elsewhere(pred, labels):
    for path in labels.iterdir():
        path.unlink()
    (labels / "readme.txt").write_text("labels are elsewhere")


def _claims_far_more(pred, labels):
    _claims_more(labels / "case_1.nii.gz")


def _random_case(pred, labels):
    """case_1 as random 40**3 masks: a deflate stream long enough to damage past the header."""
    for folder in (pred, labels):
        _mask(
            folder / "case_1.nii.gz", np.random.default_rng(0).integers(0, 2, (40, 40, 40)).astype(np.uint8)
        )
    return labels / "case_1.nii.gz"


def _cut_label(pred, labels):
    _cut_in_half(_random_case(pred, labels))


def _corrupt_label(pred, labels):
    _flip_bytes(_random_case(pred, labels))


def _nan_spacing(pred, labels):
    path = _mask(labels / "case_1.nii.gz")
    image = nib.load(path)
    header = image.header.copy()
    header["pixdim"][2] = np.nan  # edited by hand (nibabel sets a zero or negative one to its absolute or 1)
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(header.binaryblock + raw[len(header.binaryblock) :]))


@pytest.mark.parametrize(
    "breakage, message",
    [
        (_fractional, "case_1.nii.gz: holds 48 non-integer value(s) (e.g. 0.6)"),
        (_nan_mask, "case_0.nii.gz: 1 of 1152 voxel values are NaN or infinite"),
        (_label("case_1.nii.gz", np.full((12, 12, 8), -1, np.int16)), "holds negative values (-1)"),
        (_label("case_1.nii.gz", np.zeros((12, 12, 8, 3), np.uint8)), "a mask must be 3D"),
        (_nan_spacing, "voxel sizes [1.0, nan, 2.0] in its header are not all positive"),
        (_rename_labels, "no label for 2 predicted case(s): case_0, case_1 (labels are matched by file name"),
        (_labels_elsewhere, "no .nii or .nii.gz labels in it"),
        (_claims_far_more, "case_1.nii.gz: truncated"),
        (_cut_label, "case_1.nii.gz: corrupt or truncated gzip stream"),
        (_corrupt_label, "case_1.nii.gz: corrupt or truncated gzip stream"),
    ],
    ids=[
        "fractional",
        "nan",
        "negative",
        "4d",
        "nan-spacing",
        "disjoint",
        "no-labels",
        "claims-more",
        "cut",
        "corrupt",
    ],
)
def test_evaluate_refuses_what_cannot_be_scored(folders, capsys, breakage, message):
    pred, labels = folders
    breakage(pred, labels)
    assert _evaluate(pred, labels) == 2
    _one_line(capsys, message)
    _no_results(pred)


def test_evaluate_folders_that_are_missing_or_the_same(folders, tmp_path, capsys):
    pred, labels = folders
    assert _evaluate(tmp_path / "nowhere", labels) == 2
    _one_line(capsys, f"--pred {tmp_path / 'nowhere'}: does not exist")
    assert _evaluate(pred, pred / "case_0.nii.gz") == 2
    _one_line(capsys, f"--labels {pred / 'case_0.nii.gz'}: not a folder")
    assert _evaluate(pred, pred) == 2
    _one_line(capsys, "are the same folder")
    _no_results(pred)


def test_evaluate_on_a_full_filesystem_is_exit_3_and_keeps_the_previous_results(folders, capsys, monkeypatch):
    import bigmem_train.verdict.evaluation_report as evaluation_report

    pred, labels = folders
    assert _evaluate(pred, labels) == 0
    capsys.readouterr()
    before = (pred / "evaluation.json").read_text()

    def fills_up(result, out_dir):
        (out_dir / "evaluation.html").write_text("<html>half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir / "evaluation.html"))

    monkeypatch.setattr(evaluation_report, "write_evaluation_html", fills_up)
    (labels / "case_1.nii.gz").unlink()
    _mask(labels / "case_1.nii.gz", np.zeros((12, 12, 8), np.uint8))
    assert _evaluate(pred, labels) == 3
    _error_line(capsys, "the output filesystem is full", pred / "evaluation.html")
    assert (pred / "evaluation.json").read_text() == before
    assert not [path.name for path in pred.iterdir() if path.name.startswith(".partial")]
