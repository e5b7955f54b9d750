"""What ``predict`` reads: the trained model (a run directory or a ``.keras`` file) with the config it
was trained with, and the images to segment. Everything here is checked before TensorFlow is imported,
so a bad flag costs a second, not a model load.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigmem_train.config import Config, load_config
from bigmem_train.data.reader import (
    NIFTI_SUFFIXES,
    _case_name,
    _geometry,
    _load_header,
    _reason,
    check_real_type,
)
from bigmem_train.errors import BadInput

CHECKPOINTS = ("best.keras", "last.keras")


@dataclass(frozen=True)
class ModelSource:
    """A trained model file and the job config it was trained with."""

    model_path: Path
    config: Config
    config_path: Path
    input_channels: int
    output_classes: int


@dataclass(frozen=True)
class ImageCase:
    """One image to segment: its case name (the file name without .nii/.nii.gz), shape and channels."""

    name: str
    path: Path
    shape: tuple[int, int, int]
    channels: int


def _keras_model_config(path: Path) -> dict[str, Any]:
    """The model's config.json from a Keras 3 ``.keras`` archive, or BadInput naming the file."""
    try:
        with zipfile.ZipFile(path) as archive:
            return json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, OSError, ValueError):
        raise BadInput(f"{path}: not a Keras model file (a .keras archive with a config.json)") from None


@dataclass(frozen=True)
class Network:
    """What a saved U-Net is, read from its ``.keras`` file: what a config must describe to plan for it."""

    input_channels: int
    depth: int
    base_filters: int
    output_classes: int


def _network(path: Path, model_config: dict[str, Any]) -> Network:
    """The saved U-Net's channels, depth (its poolings), base filters and classes, read without Keras."""
    try:
        layer_configs = model_config["config"]["layers"]
        inputs = [layer for layer in layer_configs if layer["class_name"] == "InputLayer"]
        channels = int(inputs[0]["config"]["batch_shape"][-1])
        outputs = model_config["config"]["output_layers"]  # ["name", 0, 0], or a list of those
        output_name = outputs[0] if isinstance(outputs[0], str) else outputs[0][0]
        by_name = {layer["config"]["name"]: layer for layer in layer_configs}
        classes = int(by_name[output_name]["config"]["filters"])
        depth = sum(layer["class_name"] == "MaxPooling3D" for layer in layer_configs)
        # The first layer with filters (layers are in graph order): the first level's first convolution,
        # or its whole block when the model recomputes.
        first = next(layer for layer in layer_configs if "filters" in layer["config"])
        base_filters = int(first["config"]["filters"])
    except (KeyError, IndexError, TypeError, ValueError, StopIteration):
        raise BadInput(
            f"{path}: a Keras model, but not one of the kit's U-Nets (no volume input, levels or output)"
        ) from None
    return Network(channels, depth, base_filters, classes)


def _config_network(config: Config) -> Network:
    model = config.model
    return Network(config.num_channels, model.depth, model.base_filters, model.output_classes)


def resolve_model(spec: str | Path, config_path: str | Path | None = None) -> ModelSource:
    """``spec`` is a run directory (its best checkpoint, else its last, and its config.yaml) or a
    ``.keras`` file (with the config.yaml of the run it is in, or ``config_path``: a file or a preset).
    The config must describe the saved network (channels, depth, base filters, classes): predict plans,
    pads and normalizes by it."""
    path = Path(spec)
    if path.is_dir():
        candidates = [path / "checkpoints" / name for name in CHECKPOINTS]
        model_path = next((candidate for candidate in candidates if candidate.is_file()), None)
        if model_path is None:
            raise BadInput(
                f"--model {spec}: a folder without checkpoints/best.keras or last.keras (not a run directory)"
            )
        run_config = path / "config.yaml"
    elif path.is_file():
        model_path = path
        run_config = path.parent.parent / "config.yaml" if path.parent.name == "checkpoints" else None
    else:
        raise BadInput(f"--model {spec}: does not exist")
    if config_path:
        try:
            config = load_config(config_path)
        except BadInput as error:
            raise BadInput(f"--config {config_path}: {error}") from None
        chosen, named = Path(config_path), f"--config {config_path}"
    elif run_config is not None and run_config.is_file():
        config, chosen, named = load_config(run_config), run_config, str(run_config)
    else:
        raise BadInput(
            f"--model {spec}: no config.yaml of the run it was trained in; pass --config with the job's config"
        )
    network = _network(model_path, _keras_model_config(model_path))
    described = _config_network(config)
    if network != described:
        raise BadInput(
            f"{model_path}: the model reads {network.input_channels} channel(s) and predicts "
            f"{network.output_classes} class(es), but {named} says {described.input_channels} channel(s) "
            f"(data.channels {config.data.channels}) and {described.output_classes} class(es); the model "
            f"has depth {network.depth} and {network.base_filters} base filters, the config depth "
            f"{described.depth} and {described.base_filters}: the model and the config do not belong together"
        )
    return ModelSource(model_path, config, chosen, network.input_channels, network.output_classes)


def _nifti_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.iterdir() if path.is_file() and path.name.endswith(NIFTI_SUFFIXES))


def _listed_images(dataset_dir: Path, subset: str) -> list[Path]:
    """The images a Decathlon ``dataset.json`` lists under ``subset`` ("test" or "training")."""
    try:
        index = json.loads((dataset_dir / "dataset.json").read_text())
    except (OSError, ValueError) as error:
        raise BadInput(f"{dataset_dir / 'dataset.json'}: cannot be read ({_reason(error)})") from None
    entries = index.get(subset)
    if not isinstance(entries, list) or not entries:
        hint = (
            ": predict its labelled cases with --subset training, or the model's own validation cases with "
            "--subset validation"
            if subset == "test"
            else ""
        )
        raise BadInput(f"{dataset_dir / 'dataset.json'} lists no {subset!r} images{hint}")
    paths = []
    for entry in entries:
        relative = entry["image"] if isinstance(entry, dict) and "image" in entry else entry
        if not isinstance(relative, str):
            raise BadInput(
                f"{dataset_dir / 'dataset.json'}: a {subset!r} entry is not an image path: {entry!r}"
            )
        paths.append(dataset_dir / relative)
    return paths


def validation_names(source: ModelSource) -> set[str]:
    """The validation cases of the run the model was trained in (its split.json, beside its config.yaml)."""
    split_path = source.config_path.parent / "split.json"
    try:
        names = json.loads(split_path.read_text())["validation"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BadInput(
            f"--subset validation: needs the run the model was trained in (its split.json); "
            f"{split_path} cannot be read: give --model a run directory"
        ) from None
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise BadInput(f"--subset validation: {split_path} lists no validation cases")
    return set(names)


def _only_cases(paths: list[Path], names: set[str], spec: str) -> list[Path]:
    """The images among ``paths`` of the cases ``names``; BadInput naming the cases the dataset lacks."""
    chosen = [path for path in paths if _case_name(path) in names]
    missing = sorted(names - {_case_name(path) for path in chosen})
    if missing:
        raise BadInput(
            f"--data {spec}: its training list lacks {len(missing)} of the run's validation case(s) "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): is it the dataset the run trained on?"
        )
    return chosen


def resolve_images(specs: list[str], subset: str = "test", only: set[str] | None = None) -> list[ImageCase]:
    """The images named on the command line: NIfTI files, folders of them, or a Decathlon folder (its
    dataset.json's ``subset`` list; with ``only``, the training list's cases of those names: a run's
    validation cases). Each header is read; unreadable files, files smaller than their header says, and names
    given twice are refused (their outputs would overwrite each other)."""
    paths: list[Path] = []
    for spec in specs:
        path = Path(spec)
        if only is not None and not (path / "dataset.json").is_file():
            raise BadInput(f"--subset validation: --data {spec} is not a Decathlon folder (no dataset.json)")
        if path.is_dir():
            if (path / "dataset.json").is_file() and only is not None:
                found = _only_cases(_listed_images(path, "training"), only, spec)
            elif (path / "dataset.json").is_file():
                found = _listed_images(path, subset)
            else:
                found = _nifti_files(path)
            if not found:
                raise BadInput(f"--data {spec}: a folder without .nii or .nii.gz images")
            paths.extend(found)
        elif path.is_file():
            if not path.name.endswith(NIFTI_SUFFIXES):
                raise BadInput(f"--data {spec}: not a NIfTI image (.nii or .nii.gz)")
            paths.append(path)
        else:
            raise BadInput(f"--data {spec}: does not exist")
    cases: dict[str, ImageCase] = {}
    for path in paths:
        if not path.is_file():
            raise BadInput(f"{path}: listed but does not exist")
        image = _load_header(path)
        check_real_type(path, image)
        shape, channels = _geometry(path, image)
        name = _case_name(path)
        if name in cases:
            raise BadInput(
                f"two images are named {name}: {cases[name].path} and {path}; their masks would collide"
            )
        cases[name] = ImageCase(name, path, shape, channels)
    return list(cases.values())
