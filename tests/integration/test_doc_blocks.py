"""The README's and the guides' shell blocks that train, plan, predict and evaluate, run as written.

One folder plays the user's: a Decathlon-layout dataset where the docs say ``/data/Task01_BrainTumour``
(synthetic, with a test list as the real Task01 has), new scans and their labels, ``.venv`` the kit's own,
and the venv's ``bin`` on PATH for the guides' bare ``bigmem-train``. The blocks run in the order a reader
meets them, each in one bash, every command's exit code checked (tests/fixtures/doc_blocks.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import REPO, blocks_for, run_block, with_test_list

pytestmark = pytest.mark.slow

# The order a reader meets them: the README's training block leaves results/brats-1 for the rest.
ORDER = [
    "README.md",
    "docs/guides/train-on-your-data.md",
    "docs/guides/predict-and-evaluate.md",
]


def user_folder(folder: Path) -> dict[str, str]:
    """The files the blocks name, in ``folder``; the environment they run with."""
    from bigmem_train.data.synth import write_synthetic_dataset

    dataset = write_synthetic_dataset(folder / "data" / "Task01_BrainTumour", 10, (56, 56, 40), seed=7)
    with_test_list(dataset)
    index = json.loads((dataset / "dataset.json").read_text())
    for kind, source in (("new-scans", "imagesTr"), ("new-labels", "labelsTr")):
        (folder / "data" / kind).mkdir()
        for case in index["training"][:3]:
            name = Path(case["image"]).name
            shutil.copy(dataset / source / name, folder / "data" / kind / name)
    shutil.copy(dataset / "imagesTr" / Path(index["training"][3]["image"]).name, folder / "scan7.nii.gz")
    (folder / ".venv").symlink_to(REPO / ".venv")
    return {"PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def test_the_readme_quick_start_runs_as_written():
    """`bash scripts/setup.sh && .venv/bin/bigmem-train run` at the repository root: PASS, exit 0."""
    (block,) = [
        block for block in blocks_for("integration") if block.page == "README.md" and "setup.sh" in block.text
    ]
    before = set((REPO / "results").glob("run-*")) if (REPO / "results").is_dir() else set()
    try:
        assert run_block(block, REPO) == []
    finally:
        after = set((REPO / "results").glob("run-*")) if (REPO / "results").is_dir() else set()
        for made in after - before:
            shutil.rmtree(made, ignore_errors=True)


def test_the_training_predict_and_evaluate_blocks_run_as_written(tmp_path):
    """Each page in a folder of its own (a reader of one page has not run another's), in the order of the
    page; the predict guide uses the training guide's run as the user's ``results/brats-1``."""
    blocks = sorted(
        (block for block in blocks_for("integration") if "setup.sh" not in block.text),
        key=lambda block: (ORDER.index(block.page), block.line),
    )
    folders = {}
    for block in blocks:
        folder = tmp_path / Path(block.page).stem
        if block.page not in folders:
            folder.mkdir()
            folders[block.page] = (folder, user_folder(folder))
        if block.page == "docs/guides/predict-and-evaluate.md" and not (folder / "model.keras").exists():
            # The guide's run and model file: the training guide's run, and its best checkpoint.
            run = tmp_path / "train-on-your-data" / "results" / "brats-1"
            (folder / "results").mkdir()
            (folder / "results" / "brats-1").symlink_to(run)
            (folder / "job.yaml").write_text((run / "config.yaml").read_text())
            shutil.copy(run / "checkpoints" / "best.keras", folder / "model.keras")
        wrong = run_block(block, folder, folders[block.page][1])
        assert wrong == [], f"{block.page}:{block.line}: " + "\n".join(wrong)
    assert len(blocks) >= 8 and set(folders) == set(ORDER)
    # What the blocks promise is there: passed runs, masks for the new scans, an evaluation of them.
    for page in ("README.md", "docs/guides/train-on-your-data.md"):
        run = folders[page][0] / "results" / "brats-1"
        assert json.loads((run / "verdict.json").read_text())["verdict"] == "PASS", page
    readme = folders["README.md"][0]
    assert sorted(path.name for path in (readme / "predictions").glob("*.nii.gz")) == sorted(
        path.name for path in (readme / "data" / "new-scans").iterdir()
    )
    assert json.loads((readme / "evaluation" / "evaluation.json").read_text())["summary"]
    guide = folders["docs/guides/predict-and-evaluate.md"][0]
    test_list = json.loads((guide / "data" / "Task01_BrainTumour" / "dataset.json").read_text())["test"]
    written = {path.name for path in (guide / "predictions").glob("*.nii.gz")}
    assert {Path(name).name for name in test_list} | {"scan7.nii.gz"} <= written
    validation = json.loads((guide / "results" / "brats-1" / "split.json").read_text())["validation"]
    assert sorted(path.name for path in (guide / "validation-masks").glob("*.nii.gz")) == sorted(
        f"{name}.nii.gz" for name in validation
    )
    scored = json.loads((guide / "evaluation" / "evaluation.json").read_text())
    assert {row["case"] for row in scored["cases"]} == set(validation)
