"""Ansible's train role names an OOM kill: a single-node job whose container has a memory limit far below
its real peak (`docker run --memory` through bigmem_train_docker_extra_args) while the planner is made
wrong (a calibration file far too small, so preflight in the container accepts it). The kernel kills
the job (exit 137); the play fails with the kit's line "killed by the out-of-memory killer at about X GiB
(planned Y GiB)" read from the container's OOMKilled flag and the fetched run directory, and leaves no
container behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from bigmem_train.host import read_host_facts
from bigmem_train.ops.render import host_variables, render

from ..integration.test_memory_guard import lying_calibration
from .test_ansible_multi_worker import (
    JOB,
    ansible_playbook,
    leftover_containers,
    play,
    results_folder,
    write_play,
)

__all__ = ["ansible_playbook"]

UID = 10001
# Builds the image and trains in a container.
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.usefixtures("local_training_jobs_alone")]


def test_train_role_names_an_oom_kill(tmp_path, bigmem_image, ansible_playbook):
    results = results_folder(tmp_path / "w0")
    job = {**JOB, "strategy": "single", "epochs": 2}
    lying_calibration(results)
    # The planner's layer table, made once without a limit, so the limited run plans without a child process.
    (results / "cache").mkdir()
    (results / "job.yaml").write_text(render("train.yaml.j2", {**host_variables(read_host_facts()), **job}))
    for path in [results, *results.rglob("*")]:
        os.lchown(path, UID, UID)
    planned = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--user",
            f"{UID}:{UID}",
            "-v",
            f"{results}:/results",
            "-e",
            "BIGMEM_CACHE_DIR=/results/cache",
            "--network",
            "none",
            bigmem_image,
            "plan",
            "--config",
            "/results/job.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert planned.returncode == 0, planned.stderr
    limit = str(300 * 2**20)
    write_play(
        tmp_path,
        bigmem_image,
        {"w0": {"bigmem_train_results_dir": results}},
        bigmem_train_job=job,
        bigmem_train_docker_extra_args=[
            "--memory",
            limit,
            "--memory-swap",
            limit,
            "-e",
            "BIGMEM_CALIBRATION=/results/calibration.json",
            "-e",
            "BIGMEM_CACHE_DIR=/results/cache",
        ],
    )
    result, seconds = play(tmp_path, timeout=900)
    output = result.stdout + result.stderr
    print(f"\nOOM play: {seconds:.0f} s", file=sys.stderr)
    assert result.returncode != 0 and "failed=1" in output, output[-6000:]
    assert "exit code 137" in output and "killed by the out-of-memory killer at about" in output, output[
        -6000:
    ]
    assert "the container's OOMKilled flag is set" in output and "(planned 0.0" in output, output[-6000:]
    runs = [path for path in results.iterdir() if path.is_dir() and path.name.startswith("ansible-")]
    assert len(runs) == 1 and yaml.safe_load((runs[0] / "state.json").read_text())["state"] == "running"
    # The container ran without --rm (so its OOMKilled flag could be read); the role removed it (the same
    # unconditional task after a passing run; the PASS path is played by tests/lab/test_site.py).
    assert not leftover_containers(f"bigmem-{runs[0].name}")
