"""The Decathlon reader: index, checks, split, case preparation and the tf.data pipeline."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
from pydantic import ValidationError

from bigmem_train.config import Config
from bigmem_train.data.pipeline import bad_input_from, make_datasets
from bigmem_train.data.prepare import prepare_case
from bigmem_train.data.reader import Case, check_dataset, check_dataset_folder, read_index
from bigmem_train.data.split import check_foreground, split_cases, training_split
from bigmem_train.errors import BadInput
from tests.unit.nifti_fixtures import phantom, save_nifti, small_config, write_dataset


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data", [phantom(seed=seed) for seed in range(4)])


def one_case(tmp_path, image, label, **save_options) -> Case:
    folder = write_dataset(tmp_path / "one", [(image, label)], **save_options)
    return read_index(folder)[0]


# --- index and checks ---------------------------------------------------------------------------


def test_data_path_naming_a_file_says_it_is_not_a_folder(dataset):
    """data.path pointing at dataset.json (or any file) exists: saying it "does not exist" misleads."""
    index = dataset / "dataset.json"
    with pytest.raises(BadInput, match=r"is a file, not a folder") as refused:
        check_dataset_folder(small_config(index))
    assert "does not exist" not in str(refused.value)
    with pytest.raises(BadInput, match=r"is a file, not a folder"):
        read_index(index)
    with pytest.raises(BadInput, match=r"does not exist"):
        check_dataset_folder(small_config(dataset / "missing"))


def test_read_index_and_check_dataset(dataset):
    cases = check_dataset(small_config(dataset))
    assert [case.name for case in cases] == ["CASE_001", "CASE_002", "CASE_003", "CASE_004"]
    assert cases[0].shape == (16, 16, 12) and cases[0].channels == 4
    assert cases[0].image == dataset / "imagesTr" / "CASE_001.nii.gz"


def assert_bad_input(call, path) -> None:
    with pytest.raises(BadInput) as raised:
        call()
    message = str(raised.value)
    assert str(path) in message and "\n" not in message, message


def test_missing_folder(tmp_path):
    assert_bad_input(lambda: check_dataset(small_config(tmp_path / "absent")), tmp_path / "absent")


def test_folder_without_dataset_json(tmp_path):
    assert_bad_input(lambda: check_dataset(small_config(tmp_path)), tmp_path / "dataset.json")


def test_malformed_json(dataset):
    (dataset / "dataset.json").write_text('{"training": [')
    assert_bad_input(lambda: check_dataset(small_config(dataset)), dataset / "dataset.json")


def test_missing_training_list(dataset):
    (dataset / "dataset.json").write_text(json.dumps({"name": "x"}))
    assert_bad_input(lambda: read_index(dataset), dataset / "dataset.json")


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda training: training.append(dict(training[0])), "image"),
        (lambda training: training[1].update(image=training[0]["image"]), "image"),
        (lambda training: training[1].update(label=training[0]["label"]), "label"),
        # The same file by another spelling of its path.
        (
            lambda training: training.append(
                {**training[0], "image": "imagesTr/../imagesTr/CASE_001.nii.gz"}
            ),
            "image",
        ),
    ],
)
def test_a_case_listed_twice_is_refused(dataset, change, what):
    index = json.loads((dataset / "dataset.json").read_text())
    change(index["training"])
    (dataset / "dataset.json").write_text(json.dumps(index))
    with pytest.raises(BadInput, match=f"lists the {what} .* that training\\[0\\] lists: a case in both"):
        read_index(dataset)


def test_two_files_of_one_case_name_are_refused(dataset, tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    for folder in ("imagesTr", "labelsTr"):
        (other / folder).mkdir()
        (other / folder / "CASE_001.nii.gz").write_bytes((dataset / folder / "CASE_001.nii.gz").read_bytes())
    index = json.loads((dataset / "dataset.json").read_text())
    index["training"].append(
        {
            "image": str(other / "imagesTr" / "CASE_001.nii.gz"),
            "label": str(other / "labelsTr" / "CASE_001.nii.gz"),
        }
    )
    (dataset / "dataset.json").write_text(json.dumps(index))
    with pytest.raises(BadInput, match="lists the case name CASE_001 that training\\[0\\] lists"):
        read_index(dataset)


def test_missing_image_file(dataset):
    (dataset / "imagesTr" / "CASE_002.nii.gz").unlink()
    assert_bad_input(lambda: check_dataset(small_config(dataset)), dataset / "imagesTr" / "CASE_002.nii.gz")


def test_truncated_nifti_gz(dataset):
    path = dataset / "imagesTr" / "CASE_003.nii.gz"
    content = path.read_bytes()
    path.write_bytes(content[: len(content) * 2 // 3])
    assert_bad_input(lambda: check_dataset(small_config(dataset)), path)


def test_truncated_plain_nifti(tmp_path):
    image, label = phantom()
    folder = tmp_path / "plain"
    save_nifti(image, folder / "image.nii")
    save_nifti(label, folder / "label.nii")
    (folder / "dataset.json").write_text(
        json.dumps({"training": [{"image": "image.nii", "label": "label.nii"}]})
    )
    content = (folder / "image.nii").read_bytes()
    (folder / "image.nii").write_bytes(content[:-100])
    assert_bad_input(lambda: check_dataset(small_config(folder)), folder / "image.nii")


def test_label_shape_mismatch(tmp_path):
    image, _ = phantom()
    _, label = phantom(shape=(16, 16, 10))
    folder = write_dataset(tmp_path / "d", [(image, label)])
    assert_bad_input(lambda: check_dataset(small_config(folder)), folder / "labelsTr" / "CASE_001.nii.gz")


def test_channel_out_of_range(dataset):
    assert_bad_input(lambda: check_dataset(small_config(dataset, channels=[4])), dataset / "imagesTr")


def test_multiclass_label_out_of_range(tmp_path):
    image, label = phantom()
    label[0, 0, 0] = 7
    folder = write_dataset(tmp_path / "d", [(image, label)])
    config = small_config(folder, label_mode="multiclass")
    assert_bad_input(lambda: check_dataset(config), folder / "labelsTr" / "CASE_001.nii.gz")


def test_corrupt_file_at_read_time_names_the_path(tmp_path):
    image, label = phantom()
    case = one_case(tmp_path, image, label)
    content = case.image.read_bytes()
    case.image.write_bytes(content[: len(content) // 2])
    # All channels: the read must reach the cut (channel 0 alone lies before it and still reads).
    config = small_config(channels="all")
    assert_bad_input(lambda: prepare_case(case, config, np.random.default_rng(0)), case.image)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
def test_non_finite_image_values_are_refused_at_check_time(tmp_path, value, suffix):
    image, label = phantom()
    image[3, 4, 5, 2] = value
    image[9, 9, 9, :] = value
    folder = tmp_path / "d"
    save_nifti(image, folder / f"image{suffix}")
    save_nifti(label, folder / f"label{suffix}")
    (folder / "dataset.json").write_text(
        json.dumps({"training": [{"image": f"image{suffix}", "label": f"label{suffix}"}]})
    )
    with pytest.raises(BadInput, match=r"5 of 12288 voxel values are NaN or infinite") as caught:
        check_dataset(small_config(folder))
    assert str(folder / f"image{suffix}") in str(caught.value)
    # A file changed after the check is caught when it is read, too.
    case = read_index(folder)[0]
    assert_bad_input(lambda: prepare_case(case, small_config(channels="all")), case.image)


def test_non_finite_scan_spans_chunks(tmp_path, monkeypatch):
    """Values cut by a chunk boundary are reassembled: one NaN in the last voxel, chunks of 999 bytes."""
    import bigmem_train.data.reader as data_module

    monkeypatch.setattr(data_module, "_STREAM_CHUNK_BYTES", 999)
    image, label = phantom()
    folder = write_dataset(tmp_path / "d", [(image, label)])
    check_dataset(small_config(folder))  # clean: every float is read whole although chunks split them
    image[-1, -1, -1, -1] = np.nan
    folder = write_dataset(tmp_path / "e", [(image, label)])
    with pytest.raises(BadInput, match=r"1 of 12288 voxel values"):
        check_dataset(small_config(folder))


def test_five_dimensional_image_with_channels_in_dim5(tmp_path):
    """NIfTI's own layout for the components of one volume: (X, Y, Z, 1, C)."""
    image, label = phantom()
    case = one_case(tmp_path, image[:, :, :, None, :], label[..., None, None])
    assert case.shape == (16, 16, 12) and case.channels == 4
    check_dataset(small_config(case.image.parents[1], channels="all"))
    loaded, loaded_label = prepare_case(case, small_config(channels=[3, 1]), normalize=False)
    np.testing.assert_array_equal(loaded, image[..., [3, 1]])
    np.testing.assert_array_equal(loaded_label[..., 0], label > 0)


@pytest.mark.parametrize("shape", [(16, 16, 12, 2, 4), (16, 16, 12, 1, 1, 4)])
def test_other_higher_dimensional_images_are_refused(tmp_path, shape):
    case_image = np.zeros(shape, np.float32)
    folder = write_dataset(tmp_path / "d", [(case_image, np.zeros((16, 16, 12), np.uint8))])
    assert_bad_input(lambda: read_index(folder), folder / "imagesTr" / "CASE_001.nii.gz")


def test_empty_axis_is_refused(tmp_path):
    folder = write_dataset(
        tmp_path / "d", [(np.zeros((16, 16, 0, 4), np.float32), np.zeros((16, 16, 0), np.uint8))]
    )
    with pytest.raises(BadInput, match="has an empty axis"):
        read_index(folder)


def test_label_oriented_differently_from_the_image_is_refused(tmp_path):
    image, label = phantom()
    folder = tmp_path / "d"
    folder.mkdir()
    nib.save(nib.Nifti1Image(image, np.eye(4)), folder / "image.nii.gz")
    nib.save(nib.Nifti1Image(label, np.diag([-1.0, 1.0, 1.0, 1.0])), folder / "label.nii.gz")
    (folder / "dataset.json").write_text(
        json.dumps({"training": [{"image": "image.nii.gz", "label": "label.nii.gz"}]})
    )
    with pytest.raises(BadInput, match=r"oriented LAS but the image's are RAS") as caught:
        check_dataset(small_config(folder))
    assert str(folder / "label.nii.gz") in str(caught.value)
    # A label whose header states no orientation (sform and qform codes 0) is not compared.
    unoriented = nib.Nifti1Image(label, np.diag([-1.0, 1.0, 1.0, 1.0]))
    unoriented.set_sform(None, code=0)
    unoriented.set_qform(None, code=0)
    nib.save(unoriented, folder / "label.nii.gz")
    check_dataset(small_config(folder))


# --- reading: dtypes, scaling, channels, labels ---------------------------------------------------


def test_int16_with_scl_slope_and_inter(tmp_path):
    stored = np.arange(16 * 16 * 12 * 2, dtype=np.int16).reshape(16, 16, 12, 2) % 1000
    case = one_case(tmp_path, stored, np.zeros((16, 16, 12), np.uint8), slope=0.5, inter=3.0)
    assert nib.load(case.image).get_data_dtype() == np.int16
    image, _ = prepare_case(case, small_config(channels="all"), normalize=False)
    np.testing.assert_allclose(image, stored.astype(np.float32) * 0.5 + 3.0)


def test_float64_image(tmp_path):
    stored = np.random.default_rng(1).normal(size=(16, 16, 12, 1))
    case = one_case(tmp_path, stored, np.zeros((16, 16, 12), np.uint8))
    image, _ = prepare_case(case, small_config(), normalize=False)
    assert image.dtype == np.float32
    np.testing.assert_allclose(image, stored.astype(np.float32), rtol=1e-6)


def test_3d_single_channel_image(tmp_path):
    stored, label = phantom(channels=None)
    case = one_case(tmp_path, stored, label)
    assert case.channels == 1 and case.shape == (16, 16, 12)
    check_dataset(small_config(case.image.parents[1]))
    image, _ = prepare_case(case, small_config(), normalize=False)
    assert image.shape == (16, 16, 12, 1)
    np.testing.assert_allclose(image[..., 0], stored)
    assert_bad_input(lambda: check_dataset(small_config(case.image.parents[1], channels=[1])), case.image)


def test_channel_selection(tmp_path):
    shape = (16, 16, 12)
    stored = np.stack([np.full(shape, 10.0 * (channel + 1), np.float32) for channel in range(4)], axis=-1)
    case = one_case(tmp_path, stored, np.zeros(shape, np.uint8))
    flair, _ = prepare_case(case, small_config(channels=[0]), normalize=False)
    every, _ = prepare_case(case, small_config(channels="all"), normalize=False)
    picked, _ = prepare_case(case, small_config(channels=[3, 1]), normalize=False)
    assert flair.shape == (*shape, 1) and np.all(flair == 10)
    assert every.shape == (*shape, 4) and list(every[0, 0, 0]) == [10, 20, 30, 40]
    assert list(picked[0, 0, 0]) == [40, 20]


def test_binary_and_multiclass_labels(tmp_path):
    image, label = phantom()
    case = one_case(tmp_path, image, label)
    _, binary = prepare_case(case, small_config())
    _, classes = prepare_case(case, small_config(label_mode="multiclass"))
    assert binary.shape == classes.shape == (16, 16, 12, 1)
    assert binary.dtype == classes.dtype == np.float32
    np.testing.assert_array_equal(binary[..., 0], label > 0)
    np.testing.assert_array_equal(classes[..., 0], label)
    assert set(np.unique(classes)) == {0, 1, 2, 3}


def test_zscore_over_the_brain(tmp_path):
    image, label = phantom()
    image[..., 3] = np.where(image[..., 0] != 0, 7.0, 0.0)  # constant brain: std 0 must not give NaN
    case = one_case(tmp_path, image, label)
    prepared, _ = prepare_case(case, small_config(channels="all"))
    brain = image[..., 0] != 0
    for channel in range(3):
        values = prepared[..., channel][brain]
        assert abs(values.mean()) < 1e-5 and abs(values.std() - 1) < 1e-4
    assert np.all(prepared[~brain] == 0)
    assert np.all(np.isfinite(prepared)) and np.all(prepared[..., 3] == 0)


# --- crop and pad --------------------------------------------------------------------------------


def coded_case(tmp_path, shape):
    """A 3D image whose voxel values encode their position, and a label = (value > threshold)."""
    stored = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    label = (stored > stored.max() / 2).astype(np.uint8)
    return one_case(tmp_path, stored, label), stored


def test_validation_crop_and_pad_is_centred(tmp_path):
    case, stored = coded_case(tmp_path, (13, 21, 9))  # x padded by 3, y cropped by 5, z padded by 3
    image, label = prepare_case(case, small_config(), normalize=False)
    assert image.shape == (16, 16, 12, 1)
    expected = np.zeros((16, 16, 12), np.float32)
    expected[1:14, :, 1:10] = stored[:, 2:18, :]
    np.testing.assert_array_equal(image[..., 0], expected)
    np.testing.assert_array_equal(label[..., 0], expected > stored.max() / 2)


def test_larger_volume_centre_crop(tmp_path):
    case, stored = coded_case(tmp_path, (20, 17, 15))
    image, _ = prepare_case(case, small_config(), normalize=False)
    np.testing.assert_array_equal(image[..., 0], stored[2:18, 0:16, 1:13])


@pytest.mark.parametrize("shape", [(13, 21, 9), (23, 19, 17)])
def test_training_jitter_and_flips_keep_image_and_label_aligned(tmp_path, shape):
    case, stored = coded_case(tmp_path, shape)
    config = small_config(crop_jitter=3, augment_flips=True)
    threshold = stored.max() / 2
    seen = set()
    for seed in range(12):
        image, label = prepare_case(case, config, np.random.default_rng(seed), normalize=False)
        assert image.shape == (16, 16, 12, 1) and label.shape == (16, 16, 12, 1)
        np.testing.assert_array_equal(label, image > threshold)
        seen.add(image.tobytes())
        values = set(image[image > 0].astype(int))
        assert values <= set(stored.astype(int).ravel())
    assert len(seen) > 1  # the crop moves and flips between samples


def test_training_offset_stays_within_jitter(tmp_path):
    case, stored = coded_case(tmp_path, (24, 16, 12))  # only x is cropped: centre start 4
    config = small_config(crop_jitter=2, augment_flips=False)
    starts = set()
    for seed in range(30):
        image, _ = prepare_case(case, config, np.random.default_rng(seed), normalize=False)
        starts.add(int(np.argwhere(stored == image[0, 0, 0, 0])[0][0]))
    assert starts <= {2, 3, 4, 5, 6} and len(starts) > 1


# --- split ---------------------------------------------------------------------------------------


def make_cases(count):
    return [Case(f"C{index}", f"i{index}", f"l{index}", (1, 1, 1), 1) for index in range(count)]


def test_split_is_seeded_disjoint_and_non_empty():
    cases = make_cases(20)
    train, validation = split_cases(cases, 0.25, seed=42)
    assert len(validation) == 5 and len(train) == 15
    assert not {case.name for case in train} & {case.name for case in validation}
    assert split_cases(cases, 0.25, seed=42) == (train, validation)
    assert split_cases(cases, 0.25, seed=7) != (train, validation)
    small_train, small_validation = split_cases(make_cases(2), 0.9, seed=0)
    assert len(small_train) == len(small_validation) == 1
    with pytest.raises(BadInput):
        split_cases(make_cases(1), 0.5, seed=0)


def test_check_counts_foreground_in_the_volume_and_in_the_validation_crop(tmp_path):
    """A label whose only foreground lies outside the centre crop counts it in the volume, not the crop."""
    image, label = phantom(shape=(24, 24, 12))
    corner = np.zeros_like(label)
    corner[:3, :3, :3] = 1
    folder = write_dataset(
        tmp_path / "data", [(image, label), (image, corner), (image, np.zeros_like(label))]
    )
    counted = check_dataset(small_config(folder))  # 16x16x12 centre crop of 24x24x12: x and y 4..20
    assert [case.foreground for case in counted] == [int((label > 0).sum()), 27, 0]
    assert counted[0].centre_foreground == int((label[4:20, 4:20, :] > 0).sum()) > 0
    assert [case.centre_foreground for case in counted[1:]] == [0, 0]


def test_a_dataset_whose_labels_are_all_background_is_refused(tmp_path):
    image, label = phantom()
    folder = write_dataset(tmp_path / "data", [(image, np.zeros_like(label))] * 4)
    with pytest.raises(BadInput, match="none of the 3 training cases' labels has a foreground voxel"):
        training_split(small_config(folder, validation_fraction=0.25))


def test_a_validation_split_without_foreground_in_its_crop_is_refused(tmp_path):
    """Dice is 1.0 for predicting nothing on an all-background label: such a validation set scores nothing."""
    config = small_config(tmp_path)
    full = Case("FULL", "i", "l", (16, 16, 12), 1, foreground=50, centre_foreground=50)
    outside = Case("EDGE", "i", "l", (32, 32, 12), 1, foreground=9, centre_foreground=0)
    empty = Case("EMPTY", "i", "l", (16, 16, 12), 1, foreground=0, centre_foreground=0)
    check_foreground([full, empty], [full], config)  # some training case empty: fine
    check_foreground([full], [outside, full], config)  # one validation case scores: fine
    with pytest.raises(BadInput) as raised:
        check_foreground([full], [outside, empty], config)
    assert "no validation case (EDGE, EMPTY)" in str(raised.value) and "data.split_seed" in str(raised.value)
    with pytest.raises(BadInput, match="training cases' labels"):
        check_foreground([empty], [full], config)
    check_foreground(make_cases(2), make_cases(1), config)  # not counted: not judged


# --- tf.data -------------------------------------------------------------------------------------


def test_make_datasets_batches_and_steps(tmp_path):
    folder = write_dataset(tmp_path / "d", [phantom(shape=(18, 15, 12), seed=seed) for seed in range(5)])
    config = small_config(folder, channels=[0, 2])
    cases = check_dataset(config)
    train_cases, validation_cases = split_cases(cases, 0.4, seed=1)  # 3 train, 2 validation
    datasets = make_datasets(config, train_cases, validation_cases)
    assert (datasets.train_steps, datasets.validation_steps, datasets.channels) == (1, 1, 2)
    for image, label in datasets.train.take(3):  # repeats beyond one pass
        assert image.shape == (2, 16, 16, 12, 2) and label.shape == (2, 16, 16, 12, 1)
        assert image.dtype.name == "float32" and label.dtype.name == "float32"
    validation = list(datasets.validation)
    assert [batch[0].shape[0] for batch in validation] == [2]  # finite, one pass

    config.training.steps_per_epoch = 5
    config.training.validation_steps = 4
    config.training.batch_size = 3
    config.data.parallel_reads = "auto"
    datasets = make_datasets(config, train_cases, validation_cases)
    assert datasets.train_steps == 5 and datasets.validation_steps == 1
    assert [batch[0].shape[0] for batch in datasets.validation] == [2]  # the last batch is kept


def test_reader_in_the_step_gives_the_same_batches(tmp_path):
    """data.parallel_reads 0: no reader threads, the map runs when the step asks; same samples, same order."""
    folder = write_dataset(tmp_path / "d", [phantom(shape=(18, 15, 12), seed=seed) for seed in range(5)])
    config = small_config(folder)
    train_cases, validation_cases = split_cases(check_dataset(config), 0.4, seed=1)
    batches = {}
    for readers in (2, 0):
        config.data.parallel_reads = readers
        config.data.prefetch_batches = 1 if readers else 0
        datasets = make_datasets(config, train_cases, validation_cases)
        batches[readers] = [image.numpy() for image, _ in datasets.train.take(4)]
        batches[readers] += [image.numpy() for image, _ in datasets.validation]
    assert len(batches[0]) == len(batches[2]) == 5
    assert all(np.array_equal(a, b) for a, b in zip(batches[0], batches[2]))
    with pytest.raises(ValidationError, match="parallel_reads"):
        Config.model_validate({"data": {"parallel_reads": -1}})


def test_reader_in_the_step_reads_only_what_the_step_asks(tmp_path, monkeypatch):
    """parallel_reads 0, prefetch 0: a step that takes two batches of two has read four samples, no more;
    tf.data's own rewrites (map and batch fused, an injected prefetch) would have read ahead. Two readers
    with one batch prefetched read ahead, as they should."""
    import time

    import tensorflow as tf

    folder = write_dataset(tmp_path / "d", [phantom(shape=(18, 15, 12), seed=seed) for seed in range(6)])
    config = small_config(folder)
    config.training.batch_size = 2
    train_cases, validation_cases = split_cases(check_dataset(config), 0.2, seed=1)
    import bigmem_train.data.pipeline as data_module

    reads = []
    prepare = data_module.prepare_case

    def counted(*args, **kwargs):
        reads.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(data_module, "prepare_case", counted)

    @tf.function
    def step(iterator):
        return next(iterator)

    counts = {}
    for readers, prefetch in ((0, 0), (2, 1)):
        config.data.parallel_reads, config.data.prefetch_batches = readers, prefetch
        iterator = iter(make_datasets(config, train_cases, validation_cases).train)
        reads.clear()
        step(iterator)
        step(iterator)
        time.sleep(0.5)  # readers that run ahead have had time to
        counts[readers] = len(reads)
    assert counts[0] == 4
    assert counts[2] > 4


def test_corrupt_file_in_the_pipeline_names_the_path(tmp_path):
    folder = write_dataset(tmp_path / "d", [phantom(seed=seed) for seed in range(3)])
    config = small_config(folder, channels="all")
    cases = check_dataset(config)
    content = cases[2].image.read_bytes()
    cases[2].image.write_bytes(content[: len(content) // 2])
    datasets = make_datasets(config, cases[:2], cases[2:])
    with pytest.raises(Exception) as raised:
        list(datasets.validation)
    recovered = bad_input_from(raised.value)
    assert recovered is not None and str(cases[2].image) in str(recovered) and "\n" not in str(recovered)
    assert bad_input_from(ValueError("other")) is None
