"""predict: whole volumes of any shape back in their source's geometry, tiles that blend to the whole
volume's answer, atomic outputs that a rerun skips, the inference plan, and bad input refused before any
model is loaded.

A tiny untrained U-Net (depth 2, 4 filters) stands in for a trained one where only shapes and geometry
matter; ``pointwise`` is a stand-in engine (a per-voxel function, so a tile's answer cannot depend on its
neighbours) for checking the blending arithmetic exactly.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.infer.predict import PredictRequest, gaussian_weights, predict, predict_probabilities
from bigmem_train.infer.source import ImageCase, resolve_images, resolve_model
from bigmem_train.memory.inference import forward_live_bytes, padded_shape, plan_volume, tile_starts
from tests.fixtures.common import recorded_layer_table

JOB = {
    "data": {"channels": [1], "input_shape": [16, 16, 16], "label_mode": "binary"},
    "model": {"depth": 2, "base_filters": 4},
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `train` leaves it: config.yaml and checkpoints/best.keras (untrained)."""
    pytest.importorskip("tensorflow")
    from bigmem_train.model.unet import build_unet

    folder = tmp_path_factory.mktemp("run")
    (folder / "config.yaml").write_text(yaml.safe_dump(JOB))
    config = load_config(folder / "config.yaml")
    model = build_unet(config.model, tuple(config.data.input_shape), config.num_channels)
    (folder / "checkpoints").mkdir()
    model.save(folder / "checkpoints" / "best.keras")
    return folder


def _image(path, shape, channels=2, affine=None, five_d=False, nifti2=False, seed=0):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 800, size=(*shape, channels)).astype(np.int16)
    data[:2] = 0  # background
    if five_d:
        data = data[:, :, :, None, :]
    if affine is None:
        affine = np.array([[-1.2, 0, 0, 90], [0, 1.0, 0.1, -120], [0, 0, 2.5, -60], [0, 0, 0, 1]])
    klass = nib.Nifti2Image if nifti2 else nib.Nifti1Image
    image = klass(data, affine)
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=2)
    image.header.set_xyzt_units("mm", "sec")
    nib.save(image, path)
    return path


def labelled_run(tmp_path, shape, validation):
    """A run folder (config.yaml naming its dataset, split.json, an empty checkpoints/) and a labelled Decathlon
    dataset of four cases c1-c4 of ``shape``, ``validation`` the run's validation cases and the rest its training."""
    import yaml

    dataset = tmp_path / "Task"
    for folder in ("imagesTr", "labelsTr"):
        (dataset / folder).mkdir(parents=True)
    names = ["c1", "c2", "c3", "c4"]
    for seed, name in enumerate(names):
        image = _image(dataset / "imagesTr" / f"{name}.nii.gz", shape, seed=seed)
        channel = np.asanyarray(nib.load(image).dataobj)[..., 1]
        nib.save(
            nib.Nifti1Image((channel > 400).astype(np.uint8), np.eye(4)),
            dataset / "labelsTr" / f"{name}.nii.gz",
        )
    entries = [{"image": f"./imagesTr/{name}.nii.gz", "label": f"./labelsTr/{name}.nii.gz"} for name in names]
    (dataset / "dataset.json").write_text(json.dumps({"training": entries, "test": []}))
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    job = {**JOB, "data": {**JOB["data"], "source": "decathlon", "path": str(dataset)}}
    (folder / "config.yaml").write_text(yaml.safe_dump(job))
    train = [name for name in names if name not in validation]
    (folder / "split.json").write_text(json.dumps({"train": train, "validation": list(validation)}))
    return folder


def test_masks_keep_the_source_shape_and_geometry(run_dir, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    _image(images / "odd.nii.gz", (37, 29, 21))
    _image(images / "five_d.nii.gz", (20, 24, 18), five_d=True, seed=1)
    _image(images / "two.nii", (17, 16, 15), nifti2=True, seed=2)
    code = main(["predict", "--model", str(run_dir), "--data", str(images), "--out", str(tmp_path / "out")])
    assert code == 0
    for name in ("odd", "five_d", "two"):
        source = nib.load(next(images.glob(f"{name}.nii*")))
        mask = nib.load(tmp_path / "out" / f"{name}.nii.gz")
        assert mask.shape == source.shape[:3] and mask.get_data_dtype() == np.uint8
        assert type(mask) is type(source)
        np.testing.assert_allclose(mask.affine, source.affine, atol=1e-5)
        for form in ("qform", "sform"):
            matrix, code = getattr(mask, f"get_{form}")(coded=True)
            source_matrix, source_code = getattr(source, f"get_{form}")(coded=True)
            assert int(code) == int(source_code)
            np.testing.assert_allclose(matrix, source_matrix, atol=1e-5)
        assert mask.header.get_zooms()[:3] == pytest.approx(source.header.get_zooms()[:3])
        assert set(np.unique(np.asanyarray(mask.dataobj))) <= {0, 1}
    summary = json.loads((tmp_path / "out" / "predict.json").read_text())
    assert summary["cases"]["odd"]["window"] == [40, 32, 24]  # padded to multiples of 2**depth
    assert not list((tmp_path / "out").glob(".partial-*"))


def pointwise(volume):
    """A stand-in network: the probability of a voxel depends on that voxel alone."""
    return 1 / (1 + np.exp(-volume[..., :1]))


def test_tiles_blend_to_the_whole_volumes_answer():
    config = load_config(None, {"model.depth": 2, "model.base_filters": 4, "data.channels": [0]})
    table = recorded_layer_table("unet_depth3_filters8_float32")
    image = np.random.default_rng(0).standard_normal((30, 22, 13, 1)).astype(np.float32)
    whole = plan_volume(config, table, image.shape[:3], 1, None)
    tiled = plan_volume(config, table, image.shape[:3], 1, None, window=(8, 8, 8))
    assert whole.mode == "whole" and tiled.mode == "tiles" and tiled.tiles > 8
    expected = predict_probabilities(pointwise, image, whole)
    np.testing.assert_allclose(predict_probabilities(pointwise, image, tiled), expected, rtol=1e-5, atol=1e-6)
    mirrored = predict_probabilities(pointwise, image, tiled, tta=True)
    np.testing.assert_allclose(mirrored, expected, rtol=1e-5, atol=1e-6)


def test_tile_steps_cover_the_volume_with_half_tile_overlap():
    for length, tile in [(240, 128), (160, 64), (64, 64), (37, 16)]:
        starts = tile_starts(length, tile)
        assert starts[0] == 0 and starts[-1] + tile == max(length, tile)
        assert all(0 < b - a <= tile // 2 + 1 for a, b in zip(starts, starts[1:]))
    weights = gaussian_weights((16, 8, 12))
    assert weights.max() == pytest.approx(1.0) and weights.min() > 0
    assert weights[8, 4, 6] > weights[0, 0, 0]


def test_an_interrupted_predict_leaves_nothing_that_looks_finished_and_a_rerun_skips_done_cases(
    run_dir, tmp_path
):
    images = tmp_path / "images"
    images.mkdir()
    for index in range(3):
        _image(images / f"case{index}.nii.gz", (16, 16, 12), seed=index)
    source = resolve_model(run_dir)
    cases = resolve_images([str(images)])
    calls = []

    def failing_second(volume):
        calls.append(volume.shape)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return pointwise(volume)

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        predict(PredictRequest(source, cases, out), engine=failing_second)
    assert sorted(path.name for path in out.iterdir()) == ["case0.nii.gz", "predict.json"]
    written = json.loads((out / "predict.json").read_text())
    # What predicted what: evaluate and `remote status` read these.
    assert written["model"] == str(run_dir / "checkpoints" / "best.keras")
    assert written["config"] == str(run_dir / "config.yaml")
    assert (written["label_mode"], written["output_classes"], written["cases_total"]) == ("binary", 1, 3)
    assert (written["precision"], written["tta"]) == ("float32", False)
    first = written["cases"]
    assert sorted(first) == ["case0"]
    calls.clear()
    predict(PredictRequest(source, cases, out), engine=pointwise_counting(calls))
    assert len(calls) == 2  # case1 and case2 only
    # predict.json keeps the first run's entry for the case it did not predict again.
    summary = json.loads((out / "predict.json").read_text())["cases"]
    assert sorted(summary) == ["case0", "case1", "case2"] and summary["case0"] == first["case0"]
    assert sorted(path.name for path in out.glob("*.nii.gz")) == [
        "case0.nii.gz",
        "case1.nii.gz",
        "case2.nii.gz",
    ]


def pointwise_counting(calls):
    def engine(volume):
        calls.append(volume.shape)
        return pointwise(volume)

    return engine


def test_the_plan_goes_to_tiles_when_the_whole_volume_does_not_fit_and_refuses_below_the_smallest():
    config = load_config("study")
    table = recorded_layer_table("unet_depth4_filters16_float32")
    shape = (240, 240, 155)
    whole = plan_volume(config, table, shape, 4, None)
    assert whole.mode == "whole" and whole.padded == (240, 240, 160) == padded_shape(shape, 4)
    # The live set of the study's forward pass: at least a full-resolution 16-filter tensor and its skip.
    full_resolution = 240 * 240 * 160 * 16 * 4
    assert 2 * full_resolution <= forward_live_bytes(table, whole.window) <= 6 * full_resolution
    tiled = plan_volume(config, table, shape, 4, whole.peak_bytes - 1)
    assert tiled.mode == "tiles" and tiled.peak_bytes < whole.peak_bytes
    assert all(edge % 16 == 0 for edge in tiled.window)
    with pytest.raises(DoesNotFit, match="even in tiles of 32x32x32"):
        plan_volume(config, table, shape, 4, 2**20)


def test_predict_says_when_not_even_a_tile_fits(run_dir, tmp_path, capsys):
    image = _image(tmp_path / "one.nii.gz", (16, 16, 12))
    code = main(
        [
            "predict",
            "--model",
            str(run_dir),
            "--data",
            str(image),
            "--out",
            str(tmp_path / "o"),
            "--target",
            "1MiB",
        ]
    )
    assert code == 3
    assert "even in tiles of 8x8x8" in capsys.readouterr().err
    assert not list((tmp_path / "o").glob("*.nii.gz"))


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("not_keras", "not a Keras model file"),
        ("no_checkpoint", "a folder without checkpoints/best.keras or last.keras"),
        ("channels", "the model reads 1 channel(s) and predicts 1 class(es), but"),
        ("too_few_channels", "has 1 channel(s), too few for the model's data.channels [1]"),
        ("out_not_writable", "--out"),
        ("no_images", "a folder without .nii or .nii.gz images"),
        ("same_name", "two images are named a"),
        ("tile", "--tile 8,8: give three positive edges"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(
    run_dir, tmp_path, capsys, breakage, message
):
    model, images, out = str(run_dir), tmp_path / "images", tmp_path / "out"
    images.mkdir()
    _image(images / "a.nii.gz", (16, 16, 12))
    extra = []
    if breakage == "not_keras":
        fake = tmp_path / "model.keras"
        with zipfile.ZipFile(fake, "w") as archive:
            archive.writestr("weights.txt", "not a model")
        model, extra = str(fake), ["--config", str(run_dir / "config.yaml")]
    elif breakage == "no_checkpoint":
        (tmp_path / "run").mkdir()
        model = str(tmp_path / "run")
    elif breakage == "channels":
        # A config of another job: four classes, where the model predicts one.
        config = tmp_path / "four.yaml"
        job = {
            "model": {**JOB["model"], "output_classes": 4},
            "data": {**JOB["data"], "label_mode": "multiclass"},
        }
        config.write_text(yaml.safe_dump(job))
        model, extra = str(run_dir / "checkpoints" / "best.keras"), ["--config", str(config)]
    elif breakage == "too_few_channels":
        (images / "a.nii.gz").unlink()
        _image(images / "b.nii.gz", (16, 16, 12), channels=1)
    elif breakage == "out_not_writable":
        out.write_text("a file, not a folder")
        out = out / "masks"
    elif breakage == "no_images":
        (images / "a.nii.gz").unlink()
    elif breakage == "same_name":
        other = tmp_path / "other"
        other.mkdir()
        _image(other / "a.nii", (16, 16, 12))
        extra = ["--data", str(images), str(other)]
    elif breakage == "tile":
        extra = ["--tile", "8,8"]
    arguments = ["predict", "--model", model, "--out", str(out)]
    if "--data" not in extra:
        arguments += ["--data", str(images)]
    code = main(arguments + extra)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.is_dir() or not list(out.glob("*.nii.gz"))


def test_a_decathlon_folder_predicts_its_test_list(tmp_path):
    (tmp_path / "imagesTs").mkdir()
    _image(tmp_path / "imagesTs" / "BRATS_485.nii.gz", (8, 8, 8))
    (tmp_path / "dataset.json").write_text(
        json.dumps({"training": [], "test": ["./imagesTs/BRATS_485.nii.gz"]})
    )
    cases = resolve_images([str(tmp_path)])
    assert [case.name for case in cases] == ["BRATS_485"] and cases[0].channels == 2
    with pytest.raises(BadInput, match="lists no 'training' images"):
        resolve_images([str(tmp_path)], subset="training")
    assert isinstance(cases[0], ImageCase)


def test_the_model_is_found_as_a_run_or_as_its_checkpoint_file(run_dir, tmp_path):
    import shutil

    checkpoint = run_dir / "checkpoints" / "best.keras"
    by_run, by_file = resolve_model(run_dir), resolve_model(checkpoint)
    # A checkpoint inside a run is read with that run's config.yaml, as the run itself is.
    assert by_file.model_path == by_run.model_path == checkpoint
    assert by_file.config_path == by_run.config_path == run_dir / "config.yaml"
    # JOB: one input channel (data.channels [1]), one output class (binary labels).
    assert (by_file.input_channels, by_file.output_classes) == (1, 1)
    # A copy outside any run has no config to go with it unless --config names one.
    copy = tmp_path / "elsewhere" / "model.keras"
    copy.parent.mkdir()
    shutil.copy(checkpoint, copy)
    (copy.parent / "config.yaml").write_text((run_dir / "config.yaml").read_text())  # not a run's
    with pytest.raises(BadInput, match="no config.yaml of the run it was trained in; pass --config"):
        resolve_model(copy)
    assert resolve_model(copy, run_dir / "config.yaml").config_path == run_dir / "config.yaml"


@pytest.mark.parametrize("outputs", [[["out", 0, 0]], ["out", 0, 0]], ids=["list of outputs", "one output"])
def test_the_saved_networks_shape_is_read_from_its_layers(outputs):
    from bigmem_train.infer.source import Network, _network

    def layer(class_name, name, **config):
        return {"class_name": class_name, "config": {"name": name, **config}}

    # A depth-2 U-Net in outline: 3 input channels, 6 base filters, 4 output classes.
    layers = [
        layer("InputLayer", "image", batch_shape=[None, None, None, None, 3]),
        layer("Conv3D", "enc0", filters=6),
        layer("MaxPooling3D", "pool0"),
        layer("Conv3D", "enc1", filters=12),
        layer("MaxPooling3D", "pool1"),
        layer("Conv3D", "bottom", filters=24),
        layer("Conv3D", "dec0", filters=6),
        layer("Conv3D", "out", filters=4),
    ]
    model_config = {"config": {"layers": layers, "output_layers": outputs}}
    assert _network(Path("m.keras"), model_config) == Network(3, 2, 6, 4)


def test_the_tensorflow_engine_answers_as_the_saved_model_in_inference_mode(run_dir):
    import keras

    from bigmem_train.infer.engine import TensorFlowEngine

    checkpoint = run_dir / "checkpoints" / "best.keras"
    volume = np.random.default_rng(4).standard_normal((1, 16, 16, 16, 1)).astype(np.float32)
    saved = keras.models.load_model(checkpoint, compile=False)
    reference = np.asarray(saved(volume, training=False))
    training_mode = np.asarray(saved(volume, training=True))  # batch norm on the batch's own statistics
    assert np.abs(training_mode - reference).max() > 1e-3  # so the comparison below can tell them apart
    engine = TensorFlowEngine(checkpoint)
    np.testing.assert_allclose(engine(volume), reference, rtol=0, atol=1e-5)  # graph and eager kernels
    # Another shape than the saved input's (16^3): the engine rebuilds the network shape-free.
    other = np.random.default_rng(5).standard_normal((1, 24, 16, 8, 1)).astype(np.float32)
    assert engine(other).shape == (1, 24, 16, 8, 1)


def test_a_folder_gives_its_nifti_files_only(tmp_path):
    _image(tmp_path / "b.nii.gz", (8, 8, 8))
    _image(tmp_path / "a.nii", (8, 8, 8))
    (tmp_path / "c.nii.gz").mkdir()  # a folder with an image's name
    (tmp_path / "notes.txt").write_text("not an image\n")
    assert [case.name for case in resolve_images([str(tmp_path)])] == ["a", "b"]


def test_a_decathlon_training_list_gives_its_entries_images(tmp_path):
    # The Decathlon's training list holds {"image": ..., "label": ...} entries; the test list plain paths.
    (tmp_path / "imagesTr").mkdir()
    _image(tmp_path / "imagesTr" / "BRATS_001.nii.gz", (8, 8, 8))
    (tmp_path / "dataset.json").write_text(
        json.dumps(
            {
                "training": [
                    {"image": "./imagesTr/BRATS_001.nii.gz", "label": "./labelsTr/BRATS_001.nii.gz"}
                ],
                "test": [],
            }
        )
    )
    cases = resolve_images([str(tmp_path)], subset="training")
    assert [(case.name, case.path) for case in cases] == [
        ("BRATS_001", tmp_path / "imagesTr" / "BRATS_001.nii.gz")
    ]


def test_a_write_killed_halfway_leaves_no_mask_under_its_final_name(run_dir, tmp_path, monkeypatch):
    import bigmem_train.infer.nifti as nifti

    image = _image(tmp_path / "case.nii.gz", (16, 16, 12))
    source, cases = resolve_model(run_dir), resolve_images([str(image)])
    real_save = nifti.nib.save

    def dies_halfway(img, path):
        real_save(img, path)
        with open(path, "r+b") as file:  # the file is half written when the process dies
            file.truncate(file.seek(0, 2) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(nifti.nib, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        predict(PredictRequest(source, cases, tmp_path / "out"), engine=pointwise)
    assert not (tmp_path / "out" / "case.nii.gz").exists()
    monkeypatch.setattr(nifti.nib, "save", real_save)
    predict(PredictRequest(source, cases, tmp_path / "out"), engine=pointwise)
    assert nib.load(tmp_path / "out" / "case.nii.gz").shape == (16, 16, 12)


def test_engine_and_precision_are_checked_before_anything_runs(run_dir, tmp_path, monkeypatch, capsys):
    import bigmem_train.host as host
    import bigmem_train.infer.engine as engine

    image = _image(tmp_path / "one.nii.gz", (16, 16, 12))
    arguments = ["predict", "--model", str(run_dir), "--data", str(image), "--out", str(tmp_path / "o")]
    monkeypatch.setattr(host, "read_cpu_flags", lambda root=None: ["avx2", "avx512f"])
    assert main([*arguments, "--precision", "bfloat16"]) == 2
    assert "this CPU has no native bfloat16" in capsys.readouterr().err
    monkeypatch.setattr(engine, "openvino_available", lambda: False)
    assert main([*arguments, "--engine", "openvino"]) == 2
    assert "OpenVINO is not installed" in capsys.readouterr().err
    assert engine.resolve_engine("auto") == "tensorflow"
    assert not (tmp_path / "o").exists()


def _decathlon(folder, names, test=()):
    """A Decathlon folder of ``names`` (training, with labels) and ``test`` images."""
    (folder / "imagesTr").mkdir(parents=True)
    (folder / "imagesTs").mkdir()
    for index, name in enumerate([*names, *test]):
        _image(
            folder / ("imagesTs" if name in test else "imagesTr") / f"{name}.nii.gz", (16, 16, 12), seed=index
        )
    index = {
        "training": [
            {"image": f"./imagesTr/{name}.nii.gz", "label": f"./labelsTr/{name}.nii.gz"} for name in names
        ],
        "test": [f"./imagesTs/{name}.nii.gz" for name in test],
    }
    (folder / "dataset.json").write_text(json.dumps(index))
    return folder


def test_subset_validation_takes_the_runs_own_validation_cases(run_dir, tmp_path):
    dataset = _decathlon(tmp_path / "Task", ["c1", "c2", "c3", "c4"], test=["t1"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    (run / "checkpoints").symlink_to(run_dir / "checkpoints")
    (run / "split.json").write_text(json.dumps({"train": ["c1", "c3"], "validation": ["c4", "c2"]}))
    source = resolve_model(run)
    from bigmem_train.infer.source import validation_names

    names = validation_names(source)
    assert names == {"c2", "c4"}
    assert sorted(case.name for case in resolve_images([str(dataset)], "validation", names)) == ["c2", "c4"]
    assert [case.name for case in resolve_images([str(dataset)])] == ["t1"]
    # A dataset without the run's cases, and a model without its run, are refused naming the problem.
    other = _decathlon(tmp_path / "Other", ["c1", "c9"])
    with pytest.raises(BadInput, match=r"lacks 2 of the run's validation case\(s\) \(c2, c4\)"):
        resolve_images([str(other)], "validation", names)
    with pytest.raises(BadInput, match="needs the run the model was trained in"):
        validation_names(resolve_model(run_dir))
    # A split.json whose validation list is empty, not a list, or holds what is not a case name.
    for listed in ([], "c2", ["c2", 4]):
        (run / "split.json").write_text(json.dumps({"train": ["c1"], "validation": listed}))
        with pytest.raises(BadInput, match=r"split.json lists no validation cases"):
            validation_names(source)


def test_a_dataset_without_a_test_list_says_what_to_predict_instead(tmp_path):
    dataset = _decathlon(tmp_path / "Task", ["c1", "c2"])
    with pytest.raises(
        BadInput, match="lists no 'test' images: predict its labelled cases with --subset training"
    ):
        resolve_images([str(dataset)])


# OpenVINO's conversion child measured with `/usr/bin/time -v python -m bigmem_train.infer.engine --convert
# MODEL.keras OUT/model.xml` (EPYC, 2 cores): (parameters, maximum resident set in KiB) of the study's U-Net
# (depth 4, 16 filters, 1 channel) and of one with 32 filters and 4 channels.
CONVERSION_MEASURED = [(5_649_329, 773_496), (22_586_753, 1_102_320)]


def test_the_conversion_is_planned_as_the_envelope_of_its_measured_peaks():
    from bigmem_train.memory.inference import ENGINE_CONSTANTS, conversion_peak_bytes

    for parameters, kib in CONVERSION_MEASURED:
        table = [{"trainable_params": parameters, "non_trainable_params": 0}]
        child = conversion_peak_bytes(table) - ENGINE_CONSTANTS["openvino"][0]
        assert kib * 1024 <= child <= 1.05 * kib * 1024
    # 0.64 GiB, 5 bytes per parameter byte, and the waiting predict process's own baseline.
    table = [{"trainable_params": 1000, "non_trainable_params": 24}]
    assert conversion_peak_bytes(table) == int(0.64 * 2**30) + 5 * 4 * 1024 + int(0.156 * 2**30)


def test_predict_reports_openvinos_conversion_beside_its_plan(run_dir, tmp_path, monkeypatch):
    pytest.importorskip("openvino")
    monkeypatch.setenv("BIGMEM_CACHE_DIR", str(tmp_path / "cache"))
    images = tmp_path / "images"
    images.mkdir()
    _image(images / "one.nii.gz", (16, 16, 12))
    source, cases = resolve_model(run_dir), resolve_images([str(images)])
    first = predict(PredictRequest(source, cases, tmp_path / "first", engine="openvino"))["conversion"]
    assert first["cached"] is False and first["seconds"] > 0
    assert 0.3 * 2**30 < first["peak_rss_bytes"] < first["planned_peak_bytes"]
    again = predict(PredictRequest(source, cases, tmp_path / "again", engine="openvino"))["conversion"]
    assert again == {"planned_peak_bytes": first["planned_peak_bytes"], "cached": True}


@pytest.mark.parametrize(
    ("target", "expected", "capped"),
    [
        (None, 18 * 2**30, False),  # 20 GiB available less 10 %
        ("8GiB", 8 * 2**30, False),
        ("50%", 12 * 2**30, False),  # of the host's 24 GiB
        ("80%", 18 * 2**30, True),  # 19.2 GiB asked, 18 usable: a ceiling, planned within the usable memory
        ("30GiB", 18 * 2**30, True),
    ],
)
def test_a_target_is_a_ceiling_and_one_above_the_usable_memory_plans_within_it(
    monkeypatch, capsys, target, expected, capped
):
    """``predict --target`` bounds the plan; a target the host cannot give today (others hold the memory)
    plans within the usable memory and says so instead of refusing a prediction that fits."""
    import types

    from bigmem_train.infer import predict as predict_module

    host = types.SimpleNamespace(effective_memory_bytes=20 * 2**30, limit_total_bytes=24 * 2**30)
    monkeypatch.setattr(predict_module, "read_host_facts", lambda: host)
    limit, why = predict_module.limit_for(target, 0.10)
    assert limit == expected
    said = capsys.readouterr().err
    assert ("planning within the usable memory" in said) is capped, said
    assert ("less than --target" in why) is capped, why
    if target and not capped:
        assert why == f"--target {target}"
    with pytest.raises(BadInput, match="--target 0GiB"):
        predict_module.limit_for("0GiB", 0.10)


def test_an_earlier_predict_json_that_is_not_a_summary_is_started_afresh(tmp_path):
    from bigmem_train.infer.predict import _read_summary

    path = tmp_path / "predict.json"
    assert _read_summary(path) == {"cases": {}}  # none yet
    for text in ('{"model": "m.keras"}', '{"cases": []}', "[1, 2]", "not json"):
        path.write_text(text)
        assert _read_summary(path) == {"cases": {}}, text
    path.write_text('{"model": "m.keras", "cases": {"a": {"peak_bytes": 1}}}')
    assert _read_summary(path) == {"model": "m.keras", "cases": {"a": {"peak_bytes": 1}}}
