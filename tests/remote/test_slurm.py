"""``bigmem-train submit`` against a real one-node Slurm cluster on localhost (tests/fixtures/slurm.py):
a tiny job submitted with its plan as --mem ends COMPLETED with exit 0 and a PASS verdict; two jobs whose
--mem together exceed the node's RealMemory run one at a time, the second PENDING for Resources; an
unknown partition is one line and exit 2.

The node declares 1.5 times the tiny job's --mem as its RealMemory (a node may declare less than it has),
so that two tiny jobs cannot run side by side: memory, not CPUs, decides (each asks for one CPU).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from bigmem_train.config import load_config
from bigmem_train.host import read_host_facts
from bigmem_train.memory.plan import plan_job
from bigmem_train.ops.scheduler import bigmem_train_executable
from tests.fixtures.common import write_tiny_job

pytestmark = pytest.mark.slow

ONE_CPU = ["--set", "runtime.intra_op_threads=1"]


def _request_mib(job: Path) -> int:
    config = load_config(str(job), {"runtime.intra_op_threads": 1}, {})
    return math.ceil(plan_job(config, read_host_facts(), to_run_here=False).peak_bytes * 1.03 / 2**20)


@pytest.fixture(scope="module")
def slurm_real_memory_mib(tmp_path_factory) -> int:
    return int(_request_mib(write_tiny_job(tmp_path_factory.mktemp("plan") / "job.yaml")) * 1.5)


def submit(cluster, job: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    if not bigmem_train_executable().exists():
        pytest.skip(f"{bigmem_train_executable()} missing: the job runs the environment's bigmem-train")
    return subprocess.run(
        [
            str(bigmem_train_executable()),
            "submit",
            "--config",
            str(job),
            "--run-name",
            name,
            *ONE_CPU,
            *extra,
        ],
        env={**cluster.env, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
        cwd=job.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def wait_for(cluster, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        job = cluster.job(job_id)
        if job.get("JobState") in states:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job.get('JobState')} after {timeout} s: {job}")
        time.sleep(1)


def test_a_submitted_job_runs_with_its_plan_as_mem_and_passes(slurm_cluster, tmp_path):
    job = write_tiny_job(tmp_path / "job.yaml")
    done = submit(slurm_cluster, job, "slurm-1", "--time", "10:00")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.isdigit()
    request = _request_mib(job)
    assert slurm_cluster.job(job_id)["MinMemoryNode"] == f"{request}M"
    ended = wait_for(
        slurm_cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"}, 150
    )
    log = tmp_path / "results" / f"slurm-1.slurm-{job_id}.out"
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", log.read_text()[-3000:]
    verdict = json.loads((tmp_path / "results" / "slurm-1" / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS", verdict


def test_two_jobs_beyond_the_nodes_memory_run_one_at_a_time(slurm_cluster, tmp_path):
    job = write_tiny_job(tmp_path / "job.yaml", epochs=1)
    assert 2 * _request_mib(job) > slurm_cluster.real_memory_mib
    first = submit(slurm_cluster, job, "first")
    second = submit(slurm_cluster, job, "second")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    first_id, second_id = first.stdout.strip(), second.stdout.strip()
    try:
        wait_for(slurm_cluster, first_id, {"RUNNING"}, 30)
        time.sleep(3)  # a scheduling pass (sched_interval=2) that could have started the second
        waiting = slurm_cluster.job(second_id)
        assert waiting["JobState"] == "PENDING" and waiting["Reason"] == "Resources", waiting
        assert slurm_cluster.job(first_id)["JobState"] == "RUNNING"
    finally:
        subprocess.run(["scancel", first_id, second_id], env=slurm_cluster.env, check=False)


def test_an_unknown_partition_is_one_line(slurm_cluster, tmp_path):
    job = write_tiny_job(tmp_path / "job.yaml")
    done = submit(slurm_cluster, job, "nowhere", "--partition", "nowhere")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--partition nowhere: no such partition" in done.stderr, (
        done.stderr
    )
    assert os.listdir(tmp_path) == ["job.yaml"]
