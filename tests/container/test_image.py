"""The bigmem-train image, built once per session (tests/fixtures/docker_daemon.py) and run for real.

Every job runs in the hardened form the kit uses: no network, read-only root, /tmp on tmpfs, no
capabilities, no new privileges, the fixed non-root user, a results folder mounted at /results.
One full default job; the other training runs are shortened with --set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from bigmem_train import __version__
from tests.fixtures.common import CONTAINER_UID, results_folder

pytestmark = [pytest.mark.docker, pytest.mark.slow]

UID = CONTAINER_UID
HARDENED = [
    "--network",
    "none",
    "--read-only",
    "--tmpfs",
    "/tmp",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--user",
    f"{UID}:{UID}",
]
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# Criteria off for the short runs that check plumbing, not learning.
SHORT = ["--set", "validation.dice_floor=0.0", "--set", "validation.require_loss_decrease=false"]


def docker_run(
    image: str,
    *args: str,
    options: list[str] | None = None,
    entrypoint: str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    command = ["docker", "run", "--rm", *HARDENED, *(options or [])]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    return subprocess.run([*command, image, *args], capture_output=True, text=True, timeout=timeout)


def chown_tree(path: Path, uid: int = UID) -> None:
    if os.geteuid() == 0:
        for item in [path, *path.rglob("*")]:
            os.lchown(item, uid, uid)


def only_run_dir(results: Path) -> Path:
    runs = [path for path in results.iterdir() if (path / "state.json").exists()]
    assert len(runs) == 1, f"expected one run directory in {results}, found {runs}"
    return runs[0]


def labels(image: str) -> dict[str, str]:
    output = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(output)


def test_version_and_labels(bigmem_image: str) -> None:
    result = docker_run(bigmem_image, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"bigmem-train {__version__}"
    image_labels = labels(bigmem_image)
    assert image_labels["org.opencontainers.image.version"] == __version__
    assert image_labels["org.opencontainers.image.revision"] not in {"", "unknown"}
    assert len(image_labels["org.bigmem-train.context-sha256"]) == 64


def test_help_exits_0(bigmem_image: str) -> None:
    result = docker_run(bigmem_image, "--help")
    assert result.returncode == 0, result.stderr
    assert "Exit codes" in result.stdout


def test_user_is_not_root(bigmem_image: str) -> None:
    # Without --user: the image's own default user.
    result = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", bigmem_image],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"uid={UID}(bigmem) gid={UID}(bigmem)"), result.stdout


def test_runtime_inside_the_hardened_container(bigmem_image: str) -> None:
    """TensorFlow with oneDNN, numactl and both allocators, no pip and no compilers, under --read-only."""
    script = (
        "import json, os, shutil, sys, tensorflow as tf, keras, matplotlib.pyplot;"
        "from tensorflow.python.util import _pywrap_util_port as port;"
        "print(json.dumps({'tf': tf.__version__, 'keras': keras.__version__, 'onednn': port.IsMklEnabled(),"
        " 'numactl': shutil.which('numactl'), 'pip': shutil.which('pip'), 'gcc': shutil.which('gcc'),"
        " 'python': sys.version_info[:2], 'home': os.environ['HOME']}))"
    )
    result = docker_run(bigmem_image, "-c", script, entrypoint="python", timeout=180)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert int(facts["tf"].split(".")[1]) >= 16 and facts["tf"].startswith("2.")
    assert facts["keras"].startswith("3.")
    assert facts["onednn"] is True
    assert facts["numactl"] == "/usr/bin/numactl"
    assert facts["pip"] is None and facts["gcc"] is None
    assert facts["python"] == [3, 11]
    for library in (JEMALLOC, TCMALLOC):
        preload = docker_run(
            bigmem_image,
            "-c",
            "import tensorflow as tf; print(tf.reduce_sum(tf.ones([64, 64])).numpy())",
            options=["--env", f"LD_PRELOAD={library}"],
            entrypoint="python",
            timeout=180,
        )
        assert preload.returncode == 0, f"{library}: {preload.stderr[-2000:]}"
        assert preload.stdout.strip().endswith("4096.0")
        assert "cannot be preloaded" not in preload.stderr


def test_bad_config_exits_2_through_docker_run(bigmem_image: str, tmp_path: Path) -> None:
    results = results_folder(tmp_path / "results")
    (results / "bad.yaml").write_text("training:\n  epochz: 3\n")
    result = docker_run(
        bigmem_image, "run", "--config", "/results/bad.yaml", options=["-v", f"{results}:/results"]
    )
    assert result.returncode == 2, result.stderr
    assert "training.epochz: unknown key" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_does_not_fit_exits_3_through_docker_run(bigmem_image: str, tmp_path: Path) -> None:
    results = results_folder(tmp_path / "results")
    # The study's job (about 1 TB at batch 16) on synthetic data: refused by preflight before any write.
    result = docker_run(
        bigmem_image,
        "run",
        "--results",
        "/results",
        "--config",
        "study",
        "--set",
        "data.source=synthetic",
        options=["-v", f"{results}:/results"],
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "exceeds" in result.stderr
    assert not any(results.iterdir()), "a job that does not fit must leave nothing behind"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the results folder to another uid")
def test_results_folder_of_another_uid_exits_2_with_one_line(bigmem_image: str, tmp_path: Path) -> None:
    results = results_folder(tmp_path / "results", uid=12345, mode=0o700)
    result = docker_run(bigmem_image, options=["-v", f"{results}:/results"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "/results" in lines[0] and "not writable by uid 10001" in lines[0], lines[0]


@pytest.fixture(scope="module")
def default_run(
    bigmem_image: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The one full default job: `docker run` with no command, hardened, results mounted."""
    results = results_folder(tmp_path_factory.mktemp("default") / "results")
    result = docker_run(bigmem_image, options=["-v", f"{results}:/results"], timeout=1800)
    return result, results


def test_default_job_passes_in_the_hardened_container(
    default_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, results = default_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS" in result.stdout
    run_dir = only_run_dir(results)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS", verdict
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
    assert (run_dir / "report.html").is_file()
    # The synthetic dataset of the default job is written next to the run, in the results folder.
    assert any(path.is_dir() and (path / "dataset.json").exists() for path in results.iterdir())
    for path in results.rglob("*"):
        assert path.stat().st_uid == UID, f"{path} is not owned by the container user"


def test_validation_failure_exits_1_through_docker_run(
    bigmem_image: str, default_run, tmp_path: Path
) -> None:
    _, results = default_run
    copy = results_folder(tmp_path / "results")
    shutil.copytree(only_run_dir(results), copy / "strict", dirs_exist_ok=True)
    config = yaml.safe_load((copy / "strict" / "config.yaml").read_text())
    config["validation"]["dice_floor"] = 1.0
    (copy / "strict" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    chown_tree(copy)
    result = docker_run(bigmem_image, "validate", "/results/strict", options=["-v", f"{copy}:/results"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout


def write_brats_like_dataset(
    folder: Path, cases: int = 6, shape: tuple[int, int, int] = (40, 40, 24)
) -> Path:
    """A Decathlon Task01 layout written with nibabel, not by the kit: 4-D float32 images with the headers
    the Decathlon's BraTS volumes carry (1 mm voxels in an LPS-flipped scanner frame, qform and sform
    code 1, mm units, no scaling), uint8 labels 0..3, and the Decathlon's own dataset.json fields."""
    import nibabel as nib
    import numpy as np

    from tests.unit.nifti_fixtures import phantom

    affine = np.array([[-1.0, 0, 0, 0], [0, -1.0, 0, 239.0], [0, 0, 1.0, 0], [0, 0, 0, 1]])
    training = []
    for index in range(1, cases + 1):
        image, label = phantom(shape, channels=4, seed=index)
        name = f"BRATS_{index:03d}.nii.gz"
        for sub, data in (("imagesTr", image), ("labelsTr", label)):
            volume = nib.Nifti1Image(data, affine)
            volume.header.set_xyzt_units("mm", "sec")
            volume.header.set_qform(affine, code=1)
            volume.header.set_sform(affine, code=1)
            (folder / sub).mkdir(parents=True, exist_ok=True)
            nib.save(volume, folder / sub / name)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    (folder / "dataset.json").write_text(
        json.dumps(
            {
                "name": "BRATS",
                "tensorImageSize": "4D",
                "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
                "labels": {
                    "0": "background",
                    "1": "edema",
                    "2": "non-enhancing tumor",
                    "3": "enhancing tumour",
                },
                "numTraining": cases,
                "numTest": 0,
                "training": training,
                "test": [],
            },
            indent=4,
        )
    )
    for path in [folder, *folder.rglob("*")]:  # readable by the container's user, mounted read-only
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def test_real_data_read_only_with_a_rendered_config(bigmem_image: str, tmp_path: Path) -> None:
    """A Decathlon-layout folder the kit did not write (nibabel, real-world headers) mounted read-only at
    /data, a config rendered into /results, jemalloc."""
    dataset = write_brats_like_dataset(tmp_path / "Task01_BrainTumour")
    results = results_folder(tmp_path / "results")
    render = docker_run(
        bigmem_image,
        "render",
        "train.yaml.j2",
        "--out",
        "/results/train.yaml",
        "--var",
        "dataset_path=/data",
        "--var",
        "results_dir=/results",
        "--var",
        "allocator=jemalloc",
        "--var",
        "epochs=2",
        options=["-v", f"{results}:/results"],
    )
    assert render.returncode == 0, render.stderr
    config = yaml.safe_load((results / "train.yaml").read_text())
    assert config["data"]["source"] == "decathlon" and config["data"]["path"] == "/data"
    result = docker_run(
        bigmem_image,
        "run",
        "--config",
        "/results/train.yaml",
        "--run-name",
        "real",
        *SHORT,
        options=["-v", f"{dataset}:/data:ro", "-v", f"{results}:/results"],
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # What the training process really had mapped (/proc/self/maps, recorded by the process in metrics.json),
    # not the line the launcher prints.
    metrics = json.loads((results / "real" / "metrics.json").read_text())
    assert metrics["allocator"] == "jemalloc" and JEMALLOC in metrics["ld_preload"], metrics["allocator"]
    verdict = json.loads((results / "real" / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS"
    assert (results / "real" / "split.json").is_file()
    # Nothing was synthesized: the job read the mounted dataset.
    assert not any(path.name.startswith("synthetic-") for path in results.iterdir())


def test_predict_and_evaluate_in_the_hardened_container(
    bigmem_image: str, default_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path
) -> None:
    """The trained model and the images mounted read-only, the masks written to a writable folder, exit
    codes passing through `docker run`: 0 for a prediction, 2 for bad input, 3 when nothing fits."""
    _, results = default_run
    run_dir = only_run_dir(results)
    dataset = next(path for path in results.iterdir() if (path / "dataset.json").exists())
    out = results_folder(tmp_path / "masks")
    mounts = ["-v", f"{run_dir}:/model:ro", "-v", f"{dataset}:/data:ro", "-v", f"{out}:/out"]
    result = docker_run(
        bigmem_image,
        "predict",
        "--model",
        "/model",
        "--data",
        "/data/imagesTr",
        "--out",
        "/out",
        options=mounts,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    images = sorted(path.name for path in (dataset / "imagesTr").iterdir())
    assert sorted(path.name for path in out.glob("*.nii.gz")) == images
    assert all(path.stat().st_uid == UID for path in out.iterdir())
    evaluated = docker_run(
        bigmem_image, "evaluate", "--pred", "/out", "--labels", "/data/labelsTr", options=mounts
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    summary = json.loads((out / "evaluation.json").read_text())["summary"]["foreground"]
    assert summary["cases"] == len(images) and summary["mean_dice"] > 0.5
    bad = docker_run(
        bigmem_image,
        "predict",
        "--model",
        "/data/dataset.json",
        "--data",
        "/data/imagesTr",
        "--out",
        "/out",
        options=mounts,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    tiny = docker_run(
        bigmem_image,
        "predict",
        "--model",
        "/model",
        "--data",
        "/data/imagesTr",
        "--out",
        "/out/tiny",
        "--target",
        "1MiB",
        options=mounts,
    )
    assert tiny.returncode == 3 and "even in tiles" in tiny.stderr, tiny.stderr
