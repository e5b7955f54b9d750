"""`docker run --memory`: the memory guard's exit 3 and a named OOM kill pass through the container.

* Guard: a second process in the container (``docker exec``, another tenant of the container's cgroup) takes
  memory after the first epoch; the guard in the run (judging the container cgroup's working set) stops it
  with exit 3, which `docker run` passes on, and the container's OOMKilled flag stays false.
* OOM kill: the planner is made wrong (a calibration file far too small), preflight in the container accepts
  a limit far below the run's real peak, the kernel kills the run (exit 137, OOMKilled), and
  ``bigmem-train validate RUN_DIR`` on the host names the kill from the container's OOMKilled flag.

This machine's Docker runs on cgroup v1 (``docker info``: Cgroup Version); the same tests run on a cgroup v2
host unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.container.test_image import HARDENED, chown_tree, results_folder
from tests.fixtures.cgroups import TENANT
from tests.fixtures.common import write_tiny_job
from tests.integration.conftest import bigmem
from tests.integration.test_memory_guard import lying_calibration

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MIB = 1024**2


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def _job(results: Path, epochs: int) -> None:
    path = write_tiny_job(results / "tiny.yaml", epochs=epochs, learns=True, results=Path("/results"))
    path.write_text(path.read_text() + "guard:\n  threshold: 0.9\n")
    chown_tree(results)


def test_guard_exit_3_passes_through_docker_run(bigmem_image: str, tmp_path: Path) -> None:
    results = results_folder(tmp_path / "results")
    # Epochs enough that the tenant reaches the guard's threshold before the job ends on a fast host too (14
    # ended about 2 s after the second epoch on a fast EPYC); the guard stops it. The tenant judges the
    # cgroup's working set, as the guard does, so a cold page cache charged to the container does not
    # leave it levelling off below the threshold (tests/fixtures/cgroups.py).
    _job(results, epochs=200)
    name = f"bigmem-test-guard-{os.getpid()}"
    limit = 1024 * MIB
    started = _docker(
        "run",
        "-d",
        "--name",
        name,
        "--memory",
        str(limit),
        "--memory-swap",
        str(limit),
        *HARDENED,
        "-v",
        f"{results}:/results",
        bigmem_image,
        "run",
        "--config",
        "/results/tiny.yaml",
        "--run-name",
        "guarded",
    )
    assert started.returncode == 0, started.stderr
    try:
        tenant = _docker(
            "exec",
            "-d",
            name,
            "python",
            "-c",
            TENANT,
            "/results/guarded/history.csv",
            "2",
            str(limit),
            "0.75",
            "8",
            "0.95",
        )
        assert tenant.returncode == 0, tenant.stderr
        waited = _docker("wait", name, timeout=600)
        state = json.loads(_docker("inspect", "--format", "{{json .State}}", name).stdout)
        logs = _docker("logs", name)
    finally:
        _docker("rm", "-f", name)
    assert waited.stdout.strip() == "3", logs.stdout[-2000:] + logs.stderr[-2000:]
    assert state["ExitCode"] == 3 and state["OOMKilled"] is False
    line = logs.stderr.strip().splitlines()[-1]
    assert line.startswith("bigmem-train: error: memory guard stopped the run"), line
    assert "working set" in line and "usable 1073741824 B" in line
    run_state = json.loads((results / "guarded" / "state.json").read_text())
    assert (run_state["state"], run_state["stopped"]) == ("stopped", "memory")
    finished = len((results / "guarded" / "history.csv").read_text().strip().splitlines()) - 1
    assert (
        json.loads((results / "guarded" / "backup" / "training_metadata.json").read_text())["epoch"]
        == finished
        >= 1
    )


def test_oom_kill_in_the_container_is_named(bigmem_image: str, tmp_path: Path) -> None:
    results = results_folder(tmp_path / "results")
    _job(results, epochs=3)
    lying_calibration(results)
    # The planner's layer table, made once in a container without a limit, so the limited run plans
    # without a child process.
    (results / "cache").mkdir()
    chown_tree(results)
    common = [*HARDENED, "-v", f"{results}:/results", "-e", "BIGMEM_CACHE_DIR=/results/cache"]
    planned = _docker(
        "run", "--rm", *common, bigmem_image, "plan", "--config", "/results/tiny.yaml", timeout=300
    )
    assert planned.returncode == 0, planned.stderr
    name = f"bigmem-test-oom-{os.getpid()}"
    limit = 300 * MIB
    try:
        run = _docker(
            "run",
            "--name",
            name,
            "--memory",
            str(limit),
            "--memory-swap",
            str(limit),
            *common,
            "-e",
            "BIGMEM_CALIBRATION=/results/calibration.json",
            bigmem_image,
            "run",
            "--config",
            "/results/tiny.yaml",
            "--run-name",
            "killed",
            timeout=600,
        )
        state = json.loads(_docker("inspect", "--format", "{{json .State}}", name).stdout)
        # On the host, with the container still there to ask.
        validated = bigmem("validate", results / "killed")
    finally:
        _docker("rm", "-f", name)
    assert run.returncode == 137, run.stdout[-2000:] + run.stderr[-2000:]
    assert state["OOMKilled"] is True
    assert json.loads((results / "killed" / "state.json").read_text())["state"] == "running"
    assert validated.returncode == 1, validated.stdout + validated.stderr
    assert "killed by the out-of-memory killer at about" in validated.stdout
    assert "(planned 0.0" in validated.stdout
    assert "the container's OOMKilled flag is set" in validated.stdout
