"""The README's and the guides' container blocks, run as written against the suite's Docker daemon.

They run at the repository root (``docker/build-image.sh`` builds from it; ``$PWD/results`` is the results
folder the README names), after the session's image is built: ``docker/build-image.sh`` then finds it
current and tags it ``bigmem-train:latest``, the name the blocks run. The user's dataset folders
(``/srv/...``, ``/data/...`` before a ``-v``'s colon) are a synthetic Decathlon dataset of the test's.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.fixtures.doc_blocks import REPO, blocks_for, run_block, with_test_list

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ORDER = [
    "README.md",
    "docs/guides/container.md",
    "docs/guides/train-on-your-data.md",
    "docs/guides/predict-and-evaluate.md",
]


def test_the_container_blocks_run_as_written(bigmem_image):
    from bigmem_train.data.synth import write_synthetic_dataset

    # Not under pytest's tmp_path: its folders are the owner's only, and the image's user reads the data.
    scratch = Path(tempfile.mkdtemp(prefix="bigmem-doc-blocks-"))
    scratch.chmod(0o755)
    dataset = write_synthetic_dataset(scratch / "msd" / "Task01_BrainTumour", 8, (56, 56, 40), seed=11)
    with_test_list(dataset)
    paths = {
        "/srv/Task01_BrainTumour": str(dataset),
        "/srv/msd": str(scratch / "msd"),
        "/data/Task01_BrainTumour:/data": f"{dataset}:/data",
    }
    results = REPO / "results"
    before = set(results.iterdir()) if results.is_dir() else set()
    blocks = sorted(blocks_for("container"), key=lambda block: (ORDER.index(block.page), block.line))
    try:
        for block in blocks:
            if block.page == "docs/guides/predict-and-evaluate.md":
                # The guide's `results/brats-1`: a run of the user's, here the last one the blocks made.
                runs = sorted(set(results.glob("run-*")) - before, key=lambda path: path.stat().st_mtime)
                assert runs, "the blocks before made no run"
                (results / "brats-1").symlink_to(runs[-1].name)
            wrong = run_block(block, REPO, paths=paths)
            assert wrong == [], f"{block.page}:{block.line}: " + "\n".join(wrong)
        assert len(blocks) >= 4
        assert any((path / "verdict.json").is_file() for path in set(results.glob("run-*")) - before)
        assert list((REPO / "masks").glob("*.nii.gz"))
    finally:
        for made in (set(results.iterdir()) if results.is_dir() else set()) - before:
            if made.is_symlink() or made.is_file():
                made.unlink()
            else:
                shutil.rmtree(made, ignore_errors=True)
        shutil.rmtree(REPO / "masks", ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
