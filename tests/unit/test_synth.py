"""The synthetic writer: the exact MSD Task01 layout, valid NIfTI, visible tumours, reuse and refusal."""

from __future__ import annotations

import json
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from bigmem_train.data.reader import check_dataset
from bigmem_train.data.synth import (
    CASE_BYTES_PER_VOXEL,
    IN_PROGRESS_MARKER,
    check_case_fits,
    synthesize_case,
    write_synthetic_dataset,
)
from bigmem_train.errors import BadInput, DoesNotFit
from tests.unit.nifti_fixtures import small_config

SHAPE = (16, 16, 12)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("synth") / "data", cases=3, shape=SHAPE, seed=5)


def test_layout_and_dataset_json(written):
    index = json.loads((written / "dataset.json").read_text())
    assert index["modality"] == {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
    assert index["labels"] == {
        "0": "background",
        "1": "edema",
        "2": "non-enhancing tumor",
        "3": "enhancing tumour",
    }
    assert index["numTraining"] == 3 and index["numTest"] == 0 and index["test"] == []
    assert index["training"][0] == {
        "image": "./imagesTr/BRATS_001.nii.gz",
        "label": "./labelsTr/BRATS_001.nii.gz",
    }
    assert index["synthetic"]["shape"] == list(SHAPE) and index["synthetic"]["seed"] == 5
    assert sorted(path.name for path in (written / "imagesTr").iterdir()) == [
        "BRATS_001.nii.gz",
        "BRATS_002.nii.gz",
        "BRATS_003.nii.gz",
    ]
    assert sorted(path.name for path in written.iterdir()) == ["dataset.json", "imagesTr", "labelsTr"]


def test_files_are_valid_nifti(written):
    image = nib.load(written / "imagesTr" / "BRATS_002.nii.gz")
    label = nib.load(written / "labelsTr" / "BRATS_002.nii.gz")
    assert image.shape == (*SHAPE, 4) and label.shape == SHAPE
    assert image.get_data_dtype() == np.int16 and label.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(image.affine, np.eye(4))
    assert image.header.get_zooms()[:3] == (1.0, 1.0, 1.0)
    assert image.header.get_xyzt_units()[0] == "mm"
    values = np.asarray(label.dataobj)
    assert set(np.unique(values)) <= {0, 1, 2, 3} and (values > 0).any()


def test_reader_accepts_it(written):
    cases = check_dataset(small_config(written, channels="all", label_mode="multiclass"))
    assert len(cases) == 3 and cases[0].channels == 4 and cases[0].shape == SHAPE


def test_tumour_is_bright_in_flair_and_contrasts_differ():
    image, label = synthesize_case((40, 40, 28), np.random.default_rng(3))
    assert set(np.unique(label)) == {0, 1, 2, 3}
    flair = image[..., 0].astype(np.float64)
    head = flair > 0
    assert not head[0, 0, 0]  # background stays exactly zero
    tumour, brain = flair[label > 0], flair[head & (label == 0)]
    assert tumour.mean() > brain.mean() + 2 * brain.std()
    means = [image[..., channel][head].mean() for channel in range(4)]
    assert len({round(mean) for mean in means}) == 4
    enhancing = image[..., 2][label == 3].mean()
    assert enhancing > image[..., 1][label == 3].mean() * 1.5  # gadolinium brightens the rim in T1gd


def test_same_seed_same_data_and_cases_differ():
    first = synthesize_case(SHAPE, np.random.default_rng([1, 1]))
    again = synthesize_case(SHAPE, np.random.default_rng([1, 1]))
    other = synthesize_case(SHAPE, np.random.default_rng([1, 2]))
    np.testing.assert_array_equal(first[0], again[0])
    assert not np.array_equal(first[1], other[1])


def test_reuse_same_parameters_and_replace_different(tmp_path):
    out = tmp_path / "data"
    write_synthetic_dataset(out, cases=2, shape=SHAPE, seed=1)
    image = out / "imagesTr" / "BRATS_001.nii.gz"
    stamp = image.stat().st_mtime_ns
    write_synthetic_dataset(out, cases=2, shape=SHAPE, seed=1)
    assert image.stat().st_mtime_ns == stamp  # reused, not rewritten

    write_synthetic_dataset(out, cases=3, shape=SHAPE, seed=2)
    index = json.loads((out / "dataset.json").read_text())
    assert index["numTraining"] == 3 and index["synthetic"]["seed"] == 2
    assert len(list((out / "imagesTr").iterdir())) == 3


def test_interrupted_run_resumes(tmp_path):
    out = tmp_path / "data"
    write_synthetic_dataset(out, cases=3, shape=SHAPE, seed=1)
    reference = np.asarray(nib.load(out / "imagesTr" / "BRATS_003.nii.gz").dataobj)
    # Simulate a run stopped before case 3 and before dataset.json.
    index = json.loads((out / "dataset.json").read_text())
    (out / IN_PROGRESS_MARKER).write_text(json.dumps(index["synthetic"]))
    (out / "dataset.json").unlink()
    (out / "imagesTr" / "BRATS_003.nii.gz").unlink()
    kept = (out / "imagesTr" / "BRATS_001.nii.gz").stat().st_mtime_ns
    write_synthetic_dataset(out, cases=3, shape=SHAPE, seed=1)
    assert (out / "imagesTr" / "BRATS_001.nii.gz").stat().st_mtime_ns == kept
    np.testing.assert_array_equal(
        np.asarray(nib.load(out / "imagesTr" / "BRATS_003.nii.gz").dataobj), reference
    )
    assert (out / "dataset.json").is_file() and not (out / IN_PROGRESS_MARKER).exists()


def test_refuses_a_foreign_non_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match=str(tmp_path)):
        write_synthetic_dataset(tmp_path, cases=2, shape=SHAPE)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "dataset.json").write_text(json.dumps({"name": "BRATS", "training": []}))  # a real dataset
    with pytest.raises(BadInput):
        write_synthetic_dataset(tmp_path, cases=2, shape=SHAPE)


def test_rejects_bad_parameters(tmp_path):
    with pytest.raises(BadInput):
        write_synthetic_dataset(tmp_path / "a", cases=0, shape=SHAPE)
    with pytest.raises(BadInput):
        write_synthetic_dataset(tmp_path / "b", cases=2, shape=(16, 2, 12))


def test_a_case_too_large_for_the_host_is_refused_before_anything_is_written(tmp_path):
    # 4000^3 voxels need about 2.8 TiB to build: no test host has that.
    with pytest.raises(DoesNotFit, match=r"one case of 4000x4000x4000 needs about \d+ B \(2861.02 GiB\)"):
        write_synthetic_dataset(tmp_path / "big", cases=2, shape=(4000, 4000, 4000))
    assert not (tmp_path / "big").exists()
    check_case_fits((64, 64, 48), room_bytes=64 * 64 * 48 * CASE_BYTES_PER_VOXEL)
    with pytest.raises(DoesNotFit, match="the cgroup v2 memory limit leaves"):
        check_case_fits((64, 64, 48), room_bytes=1 << 20, room="the cgroup v2 memory limit")


def test_the_per_voxel_figure_covers_a_real_case(tmp_path):
    """Building and writing one 96^3 case allocates at most CASE_BYTES_PER_VOXEL per voxel at its peak
    (numpy's buffers, as tracemalloc counts them; in a fresh process, so nothing else is live)."""
    code = (
        "import sys, tracemalloc\n"
        "from pathlib import Path\n"
        "from bigmem_train.data.synth import write_synthetic_dataset\n"
        "tracemalloc.start()\n"
        "write_synthetic_dataset(Path(sys.argv[1]), cases=1, shape=(96, 96, 96))\n"
        "print(tracemalloc.get_traced_memory()[1])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "one")], capture_output=True, text=True, check=True
    )
    peak = int(result.stdout.split()[-1])
    # The image alone is 8 B per voxel: a peak below that would mean the measurement missed the case.
    assert 96**3 * 8 < peak <= 96**3 * CASE_BYTES_PER_VOXEL


def test_processes_asking_for_one_dataset_at_once_all_get_it_whole(tmp_path):
    """The workers of a multi-node Slurm job ask for the same dataset on one shared results folder at the
    same moment: one writes it, the others wait on the lock beside it and reuse it (without the lock they
    removed and replaced each other's partial files, and one failed)."""
    out = tmp_path / "results" / "synthetic"
    code = (
        "import sys; from pathlib import Path; from bigmem_train.data.synth import write_synthetic_dataset; "
        f"write_synthetic_dataset(Path(sys.argv[1]), cases=6, shape={SHAPE}, seed=7)"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", code, str(out)], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outcomes = [(process.wait(timeout=120), process.stderr.read()) for process in processes]
    assert [code for code, _ in outcomes] == [0, 0, 0], outcomes
    messages = " ".join(text for _, text in outcomes)
    assert messages.count("synthetic dataset: writing 6 cases") == 1, messages
    assert messages.count("synthetic dataset: reusing") == 2, messages
    assert len(check_dataset(small_config(out, channels="all", label_mode="multiclass"))) == 6
    assert sorted(path.name for path in out.iterdir()) == ["dataset.json", "imagesTr", "labelsTr"]
    assert sorted(path.name for path in out.parent.iterdir()) == [".synthetic.lock", "synthetic"]
