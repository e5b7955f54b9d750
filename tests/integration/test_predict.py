"""The researcher's loop for real: `run` trains a tiny job and judges its best checkpoint on whole
validation volumes; `predict` segments whole volumes and tiles that agree; `evaluate` scores them."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tests.integration.conftest import bigmem

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, dataset folder) of a tiny job that learns."""
    from tests.fixtures.common import write_tiny_job

    folder = tmp_path_factory.mktemp("chain")
    job = write_tiny_job(folder / "tiny.yaml", epochs=6, learns=True, results=folder / "results")
    result = bigmem("run", "--config", job, "--run-name", "chain")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    dataset = next(path for path in (folder / "results").iterdir() if (path / "dataset.json").exists())
    return folder / "results" / "chain", dataset


def _masks(folder: Path) -> dict[str, np.ndarray]:
    return {
        path.name: np.asanyarray(nib.load(path).dataobj) > 0
        for path in sorted(folder.glob("*.nii.gz"))
        if not path.name.startswith(".")
    }


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    total = a.sum() + b.sum()
    return 1.0 if total == 0 else 2 * (a & b).sum() / total


def test_the_verdict_judges_the_model_on_whole_validation_volumes(trained):
    run_dir, dataset = trained
    split = json.loads((run_dir / "split.json").read_text())
    evaluation = json.loads((run_dir / "evaluation" / "evaluation.json").read_text())
    assert sorted(case["case"] for case in evaluation["cases"]) == sorted(split["validation"])
    masks = run_dir / "evaluation" / "predictions"
    for name in split["validation"]:
        mask, image = nib.load(masks / f"{name}.nii.gz"), nib.load(dataset / "imagesTr" / f"{name}.nii.gz")
        assert mask.shape == image.shape[:3] == (40, 40, 28)  # whole volumes, not the 32x32x16 crops
    verdict = json.loads((run_dir / "verdict.json").read_text())
    floor = next(item for item in verdict["criteria"] if item["name"] == "dice_floor")
    pooled = evaluation["summary"]["foreground"]["pooled_dice"]
    assert (
        floor["passed"]
        and f"Dice {pooled:.4f} on {len(split['validation'])} whole validation" in floor["detail"]
    )
    assert "validation crops" in floor["detail"]
    assert "The model on whole validation volumes" in (run_dir / "report.html").read_text()


def test_tiles_and_whole_volumes_agree_and_evaluate_scores_them(trained, tmp_path):
    run_dir, dataset = trained
    images = dataset / "imagesTr"
    # float32, as the run's own evaluation predicted: its Dice figures are compared to 1e-4 below.
    whole = bigmem(
        "predict", "--model", run_dir, "--data", images, "--out", tmp_path / "whole", "--precision", "float32"
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    tiles = bigmem(
        "predict",
        "--model",
        run_dir,
        "--data",
        images,
        "--out",
        tmp_path / "tiles",
        "--tile",
        "24,24,24",
        "--precision",
        "float32",
    )
    assert tiles.returncode == 0, tiles.stderr[-3000:]
    assert "tiles in" in tiles.stderr
    whole_masks, tile_masks = _masks(tmp_path / "whole"), _masks(tmp_path / "tiles")
    assert len(whole_masks) == 10 and whole_masks.keys() == tile_masks.keys()
    agreement = {name: _dice(whole_masks[name], tile_masks[name]) for name in whole_masks}
    assert min(agreement.values()) >= 0.99, agreement
    # Rerunning skips what is written.
    again = bigmem(
        "predict", "--model", run_dir, "--data", images, "--out", tmp_path / "whole", "--precision", "float32"
    )
    assert again.returncode == 0 and "10 already written" in again.stderr

    scored = bigmem("evaluate", "--pred", tmp_path / "whole", "--labels", dataset / "labelsTr")
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads((tmp_path / "whole" / "evaluation.json").read_text())
    assert (
        result["summary"]["foreground"]["cases"] == 10 and result["summary"]["foreground"]["mean_dice"] > 0.5
    )
    # The run's own evaluation of its validation cases gave the same per-case Dice.
    in_run = {
        case["case"]: case["dice"]
        for case in json.loads((run_dir / "evaluation" / "evaluation.json").read_text())["cases"]
    }
    here = {case["case"]: case["dice"] for case in result["cases"]}
    assert in_run and all(here[name] == pytest.approx(dice, abs=1e-4) for name, dice in in_run.items())


def test_mirroring_averages_predictions_flipped_back(trained, tmp_path):
    run_dir, dataset = trained
    images = dataset / "imagesTr"
    plain = bigmem("predict", "--model", run_dir, "--data", images, "--out", tmp_path / "plain")
    mirrored = bigmem("predict", "--model", run_dir, "--data", images, "--out", tmp_path / "tta", "--tta")
    assert plain.returncode == 0 and mirrored.returncode == 0, mirrored.stderr[-3000:]
    a, b = _masks(tmp_path / "plain"), _masks(tmp_path / "tta")
    agreement = [_dice(a[name], b[name]) for name in a]
    # Averaging over mirrorings moves few voxels; a prediction not flipped back would move most of them.
    assert min(agreement) > 0.85, agreement


def test_engines_and_precisions_give_the_same_masks(trained, tmp_path):
    """OpenVINO against TensorFlow, and bfloat16 against float32 where the CPU has it natively: per-case
    mask Dice >= 0.99 (the condition for offering the faster one)."""
    from bigmem_train.host import read_cpu_flags
    from bigmem_train.infer.engine import openvino_available

    if not openvino_available():
        pytest.skip("OpenVINO is not installed (scripts/setup.sh installs it from the lock)")
    run_dir, dataset = trained
    images = dataset / "imagesTr"
    variants = [("tensorflow", "float32"), ("openvino", "float32")]
    if {"amx_bf16", "avx512_bf16"} & set(read_cpu_flags()):
        variants += [("tensorflow", "bfloat16"), ("openvino", "bfloat16")]
    masks = {}
    for engine, precision in variants:
        out = tmp_path / f"{engine}-{precision}"
        result = bigmem(
            "predict",
            "--model",
            run_dir,
            "--data",
            images,
            "--out",
            out,
            "--engine",
            engine,
            "--precision",
            precision,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((out / "predict.json").read_text())["engine"] == engine
        masks[engine, precision] = _masks(out)
    reference = masks["tensorflow", "float32"]
    assert sum(mask.sum() for mask in reference.values()) > 1000  # a model that segments something
    for variant, found in masks.items():
        agreement = [_dice(reference[name], found[name]) for name in reference]
        assert min(agreement) >= 0.99, (variant, agreement)
