"""Bad input ends in one clear line and exit 2, before TensorFlow is imported or anything is written."""

import gzip
import json
import subprocess
import sys

import pytest

from .conftest import bigmem


def assert_one_line_error(result, fragment):
    assert result.returncode == 2, result.stderr + result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("bigmem-train: error:") and fragment in lines[0], lines[0]


def test_typo_in_config_is_refused_before_tensorflow(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        f"training:\n  epochs: 2\n  batchsize: 4\noutput:\n  results_dir: {tmp_path / 'results'}\n"
    )
    code = (
        "import sys; from bigmem_train.cli import main; rc = main(['run', '--config', sys.argv[1]]);"
        "print('TF_IMPORTED' if 'tensorflow' in sys.modules else 'NO_TF'); sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=120
    )
    assert_one_line_error(result, "training.batchsize: unknown key")
    assert "NO_TF" in result.stdout
    assert not (tmp_path / "results").exists()


def test_unknown_flag_and_bad_override(tmp_path):
    assert bigmem("run", "--no-such-flag").returncode == 2
    assert_one_line_error(bigmem("run", "--set", "training.epochs=zero"), "training.epochs")
    assert_one_line_error(
        bigmem("plan", "--target", "12 parsecs"),
        "--target 12 parsecs: size '12 parsecs' has an unknown unit 'parsecs'",
    )
    assert_one_line_error(
        bigmem("plan", "--target", "0"), "--target 0: size '0': a memory target must be more than 0"
    )


def test_unreachable_target_is_refused_before_the_run(tmp_path):
    """The smallest job the default config can be sized to is far above 100 MiB: refused, nothing written."""
    results = tmp_path / "results"
    result = bigmem("run", "--target", "100MiB", "--results", results)
    assert_one_line_error(result, "footprint.target 104857600 B (0.10 GiB) is below the smallest job")
    assert not (list(results.iterdir()) if results.exists() else [])
    assert_one_line_error(bigmem("plan", "--target", "100MiB"), "set a target of at least")


def test_dataset_without_dataset_json(tmp_path):
    (tmp_path / "data").mkdir()
    result = bigmem("run", "--data", tmp_path / "data", "--results", tmp_path / "results")
    assert_one_line_error(result, "dataset.json")
    assert not list((tmp_path / "results").glob("run-*")) if (tmp_path / "results").exists() else True


def test_truncated_nifti_names_the_file_and_leaves_no_finished_run(tmp_path):
    data = tmp_path / "data"
    assert bigmem("synth", "--out", data, "--cases", 4, "--shape", "32,32,16").returncode == 0
    index = json.loads((data / "dataset.json").read_text())
    victim = data / index["training"][1]["image"]
    blob = victim.read_bytes()
    victim.write_bytes(blob[: len(blob) // 2])
    results = tmp_path / "results"
    result = bigmem(
        "run",
        "--data",
        data,
        "--results",
        results,
        "--set",
        "data.input_shape=[32,32,16]",
        "--set",
        "training.batch_size=1",
        "--set",
        "model.base_filters=4",
    )
    assert_one_line_error(result, victim.name)
    runs = list(results.glob("run-*")) if results.exists() else []
    assert not runs, f"a run directory was left behind: {runs}"


def test_corrupt_gzip_header(tmp_path):
    data = tmp_path / "data"
    assert bigmem("synth", "--out", data, "--cases", 3, "--shape", "32,32,16").returncode == 0
    index = json.loads((data / "dataset.json").read_text())
    victim = data / index["training"][0]["label"]
    victim.write_bytes(gzip.compress(b"this is not a NIfTI file at all" * 10))
    result = bigmem(
        "run",
        "--data",
        data,
        "--results",
        tmp_path / "results",
        "--set",
        "data.input_shape=[32,32,16]",
        "--set",
        "training.batch_size=1",
    )
    assert_one_line_error(result, victim.name)


def test_labels_with_no_foreground_are_refused_before_training(tmp_path):
    """All-background labels would score validation Dice 1.0 for predicting nothing: refused, exit 2."""
    import nibabel as nib
    import numpy as np

    data = tmp_path / "data"
    assert bigmem("synth", "--out", data, "--cases", 4, "--shape", "32,32,16").returncode == 0
    for entry in json.loads((data / "dataset.json").read_text())["training"]:
        label = nib.load(data / entry["label"])
        nib.save(nib.Nifti1Image(np.zeros(label.shape, np.uint8), label.affine), data / entry["label"])
    results = tmp_path / "results"
    result = bigmem("run", "--data", data, "--results", results, "--set", "data.input_shape=[32,32,16]")
    assert_one_line_error(result, "labels has a foreground voxel (every value is 0)")
    assert not (list(results.glob("run-*")) if results.exists() else [])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["synth", "--out", "X", "--shape", "1,2"], "--shape"),
        (["validate", "/nonexistent/run"], "does not exist"),
        (["report", "/nonexistent/run"], "not a bigmem-train run"),
    ],
)
def test_other_commands_reject_bad_input(tmp_path, args, fragment):
    args = [str(tmp_path / a) if a == "X" else a for a in args]
    assert_one_line_error(bigmem(*args), fragment)
