"""The README's and the remote guide's `bigmem-train remote` blocks, run as written over the suite's sshd.

A folder of the test's plays the workstation: ``inventory.ini`` names the hosts the blocks use
(``bigmem-01``, group ``bigmem``) at the sshd on 127.0.0.1, the jobs folder ``bigmem-train`` beside it
(what the docs' relative ``bigmem-train/jobs/...`` is in the login's home), ``job.yaml`` and
``job-2x.yaml`` are tiny jobs, and ``bigmem-train`` on PATH is the package under test. The host runs its
jobs in containers of the suite's image (tagged ``bigmem-train``, the blocks' default) in the local Docker
daemon. The user's paths on the host (``/srv/...``) are a tiny synthetic Decathlon dataset, a folder of
its scans and the README's trained run. The blocks run in the order a reader meets them, each in one bash,
every command's exit code checked (tests/fixtures/doc_blocks.py). Between them the test checks what they
wrote, removes the multi-worker job the README only starts, and the predict job's container that a block
starts again by hand; it waits for the predict jobs the blocks left running. Last, ``job.yaml`` becomes the
multi-worker job of the guide's scale-out step 1, which its step 3 starts on the group, follows to its end,
fetches and stops.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.common import free_port, write_tiny_job
from tests.fixtures.doc_blocks import REMOTE, WHERE, all_blocks, run_block, with_test_list

from .test_remote import host_executable

pytestmark = [pytest.mark.slow, pytest.mark.docker]

ORDER = ["README.md", "docs/guides/remote-and-scale-out.md"]
# The containers the blocks start: named after their jobs, in the daemon that plays every host's.
CONTAINERS = ["brats-1", "brats-1-scans", "brats-2x", "brats-1tb", "brats-1tb-test", "brats-1-train"]


def workstation(folder: Path, sshd) -> tuple[dict[str, str], dict[str, str]]:
    """The blocks' files in ``folder``; the environment they run with and the user's paths on the host."""
    from bigmem_train.data.synth import write_synthetic_dataset

    (folder / "bin").mkdir()
    host_executable(folder / "bin")
    keys = folder / "keys"
    keys.mkdir()
    (keys / "bigmem_ed25519").write_bytes(sshd.key_file.read_bytes())
    (keys / "bigmem_ed25519").chmod(0o600)
    (folder / "inventory.ini").write_text(f"""\
[bigmem]
bigmem-01 ansible_host={sshd.host} ansible_port={sshd.port} bigmem_train_worker_port={free_port()}

[bigmem:vars]
ansible_user={sshd.user}
ansible_ssh_private_key_file=keys/bigmem_ed25519
bigmem_train_remote_dir={folder}/bigmem-train
""")
    # Two epochs of three steps (the verdict wants the loss to fall): `logs --follow` ends within seconds.
    # The group is one host: every worker's container would be named brats-2x in the one daemon that plays
    # all hosts.
    write_tiny_job(folder / "job.yaml", epochs=2)
    write_tiny_job(folder / "job-2x.yaml", epochs=2, strategy="multi_worker")
    host = folder / "srv"
    dataset = write_synthetic_dataset(host / "Task01_BrainTumour", 4, (24, 24, 16), seed=5)
    with_test_list(dataset, count=2)
    (host / "scans").mkdir()
    for image in sorted((dataset / "imagesTr").glob("*.nii.gz"))[:2]:
        shutil.copy(image, host / "scans" / image.name)
    paths = {
        "/srv/Task01_BrainTumour": str(dataset),
        "/srv/scans": str(host / "scans"),
        # A run directory on the host: the README's training job.
        "/srv/models/brats-1": f"{folder}/bigmem-train/jobs/brats-1/results/brats-1",
    }
    environment = {
        "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    return environment, paths


def docker(*args: str, timeout: float = 600) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    return result.stdout.strip()


def finished(name: str) -> str:
    """Wait for the container of a job a block left running; its log (exit 0 asserted)."""
    code = docker("wait", name)
    log = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=60)
    assert code == "0", f"{name}: exit {code}: " + (log.stdout + log.stderr)[-3000:]
    return log.stdout + log.stderr


def masks(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("*.nii.gz"))


def test_the_remote_blocks_run_as_written(tmp_path, sshd, bigmem_image):
    blocks = sorted(
        (block for block in all_blocks() if getattr(WHERE.get(block.key), "runs", None) == REMOTE),
        key=lambda block: (ORDER.index(block.page), block.line),
    )
    assert [(block.page, len(block.commands)) for block in blocks] == [
        ("README.md", 4),
        ("docs/guides/remote-and-scale-out.md", 8),
        ("docs/guides/remote-and-scale-out.md", 5),
        ("docs/guides/remote-and-scale-out.md", 1),
        ("docs/guides/remote-and-scale-out.md", 5),
    ]
    taken = set(docker("ps", "-a", "--format", "{{.Names}}").split()) & set(CONTAINERS)
    if taken:
        pytest.fail(f"containers named as the blocks' jobs exist already (remove them): {sorted(taken)}")
    # The blocks run the image by its default name.
    subprocess.run(["docker", "tag", bigmem_image, "bigmem-train:latest"], check=True, timeout=60)
    folder = tmp_path
    environment, paths = workstation(folder, sshd)
    jobs = folder / "bigmem-train" / "jobs"
    dataset = Path(paths["/srv/Task01_BrainTumour"])
    began, seconds = time.monotonic(), {}

    def run(block, timeout: float = 900) -> None:
        started = time.monotonic()
        wrong = run_block(block, folder, environment, paths, timeout=timeout)
        seconds[f"{Path(block.page).name}:{block.line}"] = round(time.monotonic() - started)
        assert wrong == [], f"{block.page}:{block.line}: " + "\n".join(wrong)

    try:
        readme, commands, predict, docker_run, group = blocks

        # README: train and follow it, predict with its model (left running), a multi-worker job on the group.
        run(readme)
        job = json.loads((jobs / "brats-2x" / "job.json").read_text())
        environment_2x = docker("inspect", "--format", "{{json .Config.Env}}", "brats-2x")
        assert job["multi_worker"] and "TF_CONFIG=" in environment_2x, (job, environment_2x)
        # Started is all the README shows of it: the job would train on beside the blocks that follow. The
        # guide's scale-out step starts brats-2x anew.
        docker("rm", "-f", "brats-2x")
        shutil.rmtree(jobs / "brats-2x")
        trained = jobs / "brats-1" / "results" / "brats-1"
        assert json.loads((trained / "verdict.json").read_text())["verdict"] == "PASS"

        # The guide's commands: one container job (the other two starts refused while it runs), its status,
        # log, stop and fetch.
        run(commands)
        fetched = folder / "results" / "brats-1tb"
        assert json.loads((fetched / "verdict.json").read_text())["verdict"] == "PASS"
        assert (fetched / "checkpoints" / "best.keras").is_file()
        assert "PASS" in (fetched / "job.log").read_text()

        # Predict on the server: with the guide's job's model (left running), with a run directory and labels.
        run(predict)
        scored = folder / "results" / "brats-1-train"
        assert len(masks(scored)) == 4 and json.loads((scored / "evaluation.json").read_text())["cases"]

        # What remote predict ran on the host, by hand: the job's container and masks go first.
        docker("rm", "-f", "brats-1-train")
        shutil.rmtree(jobs / "brats-1-train" / "results" / "brats-1-train")
        run(docker_run, timeout=300)
        assert "EVALUATED" in finished("brats-1-train")
        assert len(masks(jobs / "brats-1-train" / "results" / "brats-1-train")) == 4

        # The predict jobs the blocks left running.
        assert "PREDICTED 2 case(s)" in finished("brats-1-scans")
        scans = sorted(path.name for path in Path(paths["/srv/scans"]).iterdir())
        assert masks(jobs / "brats-1-scans" / "results" / "brats-1-scans") == scans
        assert "PREDICTED 2 case(s)" in finished("brats-1tb-test")
        test_list = json.loads((dataset / "dataset.json").read_text())["test"]
        assert masks(jobs / "brats-1tb-test" / "results" / "brats-1tb-test") == sorted(
            Path(name).name for name in test_list
        )

        # Scale-out: step 1's job.yaml (training.strategy multi_worker) started on the group, its status, log
        # to the end, fetch and stop. The group is one host (see workstation): one worker.
        write_tiny_job(folder / "job.yaml", epochs=2, strategy="multi_worker")
        run(group)
        scaled = folder / "results" / "brats-2x"
        assert json.loads((scaled / "verdict.json").read_text())["verdict"] == "PASS"
        metrics = json.loads((scaled / "metrics.json").read_text())
        assert (metrics["strategy"], metrics["workers"]) == ("multi_worker", 1), metrics
    finally:
        docker("rm", "-f", *CONTAINERS, timeout=120)
        print(f"\nremote doc blocks: {time.monotonic() - began:.0f} s {seconds}", file=sys.stderr)
