"""``bigmem-train submit`` and ``bigmem-train slurm`` against a real one-node Slurm cluster on localhost
(tests/fixtures/slurm.py): a tiny job submitted with its plan as --mem, from a folder whose name has a space,
ends COMPLETED with exit 0 and a PASS verdict, and ``slurm status``/``fetch`` show and copy it; a job that
fails validation ends FAILED with ExitCode 1:0; two jobs whose --mem together exceed the node's RealMemory run
one at a time, the second PENDING for Resources; one running job is watched with ``slurm status``/``logs`` and
stopped with ``slurm stop``; bad input (unknown partition, --nodes beyond the partition, a bad --time, no
Slurm client, no controller) is one line, exit 2, and nothing submitted; every --time form ``submit`` accepts,
sbatch accepts. On a second cluster that kills a job whose RSS passes its --mem (jobacct_gather's
OverMemoryKill, no cgroups), the kit's batch script with a --mem below what the job touches is killed, and
``validate`` names Slurm's kill for memory, exit 1. On a third that enforces --mem through the kernel
(task/cgroup, cgroup v1), the job asked for with its plan runs inside that limit and passes, one given less
than its plan is refused by its own preflight (exit 3), and one that outgrows its limit ends OUT_OF_MEMORY and
validate names it. On a fourth, of two nodes (one slurmd in each of two network namespaces), a multi_worker
job submitted with ``--nodes 2`` runs one worker on each node, with one worker's plan as --mem, and the
chief's verdict passes. With ``--image`` (marker ``docker``), the tiny job runs in the suite's image on the
one node and passes (and one made to fail validation ends FAILED, ExitCode 1:0), ``slurm stop`` of a running
one leaves no container behind, and an image Docker does not know is one line, exit 2, nothing submitted.

The node declares 1.5 times the tiny job's --mem as its RealMemory (a node may declare less than it has),
so that two tiny jobs cannot run side by side: memory, not CPUs, decides (each asks for one CPU).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import read_host_facts
from bigmem_train.memory.plan import plan_job
from bigmem_train.ops.scheduler import bigmem_train_executable, check_time
from bigmem_train.verdict.postmortem import SLURM_ENDED, container_id
from tests.fixtures.common import free_port, write_tiny_job
from tests.fixtures.slurm import NETWORK

pytestmark = pytest.mark.slow

ONE_CPU = ["--set", "runtime.intra_op_threads=1"]
# Above what the tiny job holds when its run directory exists (under 300 MiB of RSS: Python, the kit, the
# synthetic data), below what it holds once TensorFlow is loaded (over 0.4 GiB, peaking near 1 GiB).
KILL_MEM_MIB = 360
ACCEPTED_TIMES = ["30", "30:00", "2:30:00", "1-12", "1-12:30", "1-12:30:15", "UNLIMITED", "unlimited", "0"]


def _request_mib(job: Path) -> int:
    config = load_config(str(job), {"runtime.intra_op_threads": 1}, {})
    # The plan with its 3 % coverage, under the memory guard's 97 % of the limit.
    return math.ceil(plan_job(config, read_host_facts(), to_run_here=False).peak_bytes * 1.03 / 0.97 / 2**20)


def _worker_request_mib(job: Path, workers: int, monkeypatch) -> int:
    """--mem of one worker of ``workers``, planned as `run` plans it on its node: with TF_CONFIG naming them."""
    addresses = [f"w{index}:1" for index in range(workers)]
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": 0}})
    )
    try:
        return _request_mib(job)
    finally:
        monkeypatch.delenv("TF_CONFIG")


@pytest.fixture(scope="module")
def slurm_real_memory_mib(tmp_path_factory) -> int:
    return int(_request_mib(write_tiny_job(tmp_path_factory.mktemp("plan") / "job.yaml")) * 1.5)


def bigmem_train(
    cluster, folder: Path, *arguments: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    """This environment's ``bigmem-train ARGUMENTS`` in ``folder``, a client of ``cluster``."""
    if not bigmem_train_executable().exists():
        pytest.skip(f"{bigmem_train_executable()} missing: the job runs the environment's bigmem-train")
    return subprocess.run(
        [str(bigmem_train_executable()), *arguments],
        env={**(env or cluster.env), "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def submit(
    cluster, job: Path, name: str, *extra: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    return bigmem_train(
        cluster, job.parent, "submit", "--config", str(job), "--run-name", name, *ONE_CPU, *extra, env=env
    )


def job_ids(cluster) -> set[str]:
    """Every job the controller knows (squeue orders them by state, which changes as jobs end)."""
    return set(
        subprocess.run(
            ["squeue", "-h", "-t", "all", "-o", "%i"],
            env=cluster.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )


def wait_for(cluster, job_id: str, states: frozenset[str] | set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        job = cluster.job(job_id)
        if job.get("JobState") in states:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job.get('JobState')} after {timeout} s: {job}")
        time.sleep(1)


def test_a_submitted_job_runs_with_its_plan_as_mem_and_passes(slurm_cluster, tmp_path):
    folder = tmp_path / "lab share"  # the #SBATCH lines quote the output and work folder
    folder.mkdir()
    job = write_tiny_job(folder / "job.yaml")
    done = submit(slurm_cluster, job, "slurm-1", "--time", "10:00")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.isdigit()
    request = _request_mib(job)
    assert slurm_cluster.job(job_id)["MinMemoryNode"] == f"{request}M"
    ended = wait_for(slurm_cluster, job_id, SLURM_ENDED, 150)
    log = folder / "results" / f"slurm-1.slurm-{job_id}.out"
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", log.read_text()[-3000:]
    verdict = json.loads((folder / "results" / "slurm-1" / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS", verdict
    status = bigmem_train(slurm_cluster, folder, "slurm", "status", "slurm-1")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == f"slurm-1: Slurm job {job_id} COMPLETED on {slurm_cluster.node}, exit code 0", lines
    assert "  verdict: PASS" in lines and f"  log: {log}" in lines
    fetched = bigmem_train(slurm_cluster, folder, "slurm", "fetch", job_id, "--to", str(tmp_path / "copy"))
    assert fetched.stdout.strip() == f"fetched {tmp_path / 'copy' / 'slurm-1'}; verdict PASS", fetched.stderr
    assert (tmp_path / "copy" / "slurm-1" / "job.log").read_text() == log.read_text()


def test_a_job_that_fails_validation_ends_failed_with_exit_code_1(slurm_cluster, tmp_path):
    job = write_tiny_job(tmp_path / "job.yaml", epochs=1)
    done = submit(slurm_cluster, job, "fails", "--set", "validation.dice_floor=1.0")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    ended = wait_for(slurm_cluster, job_id, SLURM_ENDED, 150)
    log = tmp_path / "results" / f"fails.slurm-{job_id}.out"
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "1:0"), log.read_text()[-3000:]
    verdict = json.loads((tmp_path / "results" / "fails" / "verdict.json").read_text())
    assert verdict["verdict"] == "FAIL", verdict
    status = bigmem_train(slurm_cluster, tmp_path, "slurm", "status", job_id)
    assert status.stdout.startswith(f"fails: Slurm job {job_id} FAILED (NonZeroExitCode) on "), status.stdout
    assert ", exit code 1\n" in status.stdout and "  verdict: FAIL" in status.stdout


def test_two_jobs_beyond_the_nodes_memory_run_one_at_a_time_and_slurm_commands_watch_and_stop_one(
    slurm_cluster, tmp_path
):
    """The first job trains long enough to be watched: slurm status and logs while it runs, then slurm stop;
    the second waits for it (the status of a pending job names Slurm's reason)."""
    job = write_tiny_job(tmp_path / "job.yaml", epochs=200)
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
        pending = bigmem_train(slurm_cluster, tmp_path, "slurm", "status", "second")
        assert pending.stdout.startswith(f"second: Slurm job {second_id} PENDING (Resources)\n"), pending

        deadline = time.monotonic() + 120  # the first epoch's steps: the graph is traced first
        while not (tmp_path / "results" / "first" / "progress.json").exists():
            assert time.monotonic() < deadline, (
                tmp_path / "results" / f"first.slurm-{first_id}.out"
            ).read_text()
            time.sleep(1)
        status = bigmem_train(slurm_cluster, tmp_path, "slurm", "status", "first", "--json")
        report = json.loads(status.stdout)
        assert (report["state"], report["host"], report["run_state"]) == (
            "RUNNING",
            slurm_cluster.node,
            "running",
        )
        assert report["epochs"] == 200 and report["epoch"] >= 1 and report["live_rss_bytes"] > 0, report
        logs = bigmem_train(slurm_cluster, tmp_path, "slurm", "logs", first_id, "--lines", "200")
        assert logs.returncode == 0 and "bigmem-train: training (16, 16, 16) x batch 2" in logs.stdout, logs

        stop = bigmem_train(slurm_cluster, tmp_path, "slurm", "stop", "first")
        assert stop.stdout.startswith(f"first: Slurm job {first_id} cancelled (CANCELLED)"), stop
        assert slurm_cluster.job(first_id)["JobState"] == "CANCELLED"
        assert (tmp_path / "results" / "first" / "checkpoints").is_dir()  # resumable: the run stays
        again = bigmem_train(slurm_cluster, tmp_path, "slurm", "stop", first_id)
        assert again.stdout.strip() == f"first: Slurm job {first_id} is not running (CANCELLED)", again
    finally:
        subprocess.run(["scancel", first_id, second_id], env=slurm_cluster.env, check=False)


def _containers(name: str) -> list[str]:
    """Docker's containers (running or not) named ``name``."""
    listed = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", f"name=^/{name}$"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return listed.stdout.split()


@pytest.mark.docker
def test_a_job_submitted_with_image_runs_in_the_container_and_passes(slurm_cluster, bigmem_image, tmp_path):
    """--image: the batch script runs the job in the kit's image (the suite's own build) on the node, its
    results folder mounted at /results, held to the job's --mem by its own cgroup; the job ends COMPLETED,
    exit 0, verdict PASS, its container removed."""
    job = write_tiny_job(tmp_path / "job.yaml")
    done = submit(slurm_cluster, job, "img-1", "--image", bigmem_image, "--time", "10:00")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert slurm_cluster.job(job_id)["MinMemoryNode"] == f"{_request_mib(job)}M"
    ended = wait_for(slurm_cluster, job_id, SLURM_ENDED, 240)
    log = tmp_path / "results" / f"img-1.slurm-{job_id}.out"
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", log.read_text()[-3000:]
    run_dir = tmp_path / "results" / "img-1"
    assert json.loads((run_dir / "verdict.json").read_text())["verdict"] == "PASS"
    state = json.loads((run_dir / "state.json").read_text())
    # It ran in a container, and kept Slurm's record of the job (the variables the script passes in).
    assert container_id(state) and state["slurm"]["job_id"] == job_id, state
    # Docker's cgroup held it to the job's --mem (Slurm's cgroup does not see a container's processes).
    assert state["cgroup"]["limit_bytes"] == _request_mib(job) * 2**20, state["cgroup"]
    assert "bigmem-train: run directory /results/img-1" in log.read_text(), log.read_text()[-3000:]
    assert _containers("img-1") == []
    status = bigmem_train(slurm_cluster, tmp_path, "slurm", "status", "img-1").stdout.splitlines()
    assert status[0] == f"img-1: Slurm job {job_id} COMPLETED on {slurm_cluster.node}, exit code 0", status
    assert "  verdict: PASS" in status


@pytest.mark.docker
def test_an_image_job_that_fails_validation_ends_failed_with_exit_code_1(
    slurm_cluster, bigmem_image, tmp_path
):
    """The container's exit code is the job's: Slurm's ExitCode is the verdict, as with --venv."""
    job = write_tiny_job(tmp_path / "job.yaml", epochs=1)
    done = submit(
        slurm_cluster, job, "img-fails", "--image", bigmem_image, "--set", "validation.dice_floor=1.0"
    )
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    ended = wait_for(slurm_cluster, job_id, SLURM_ENDED, 240)
    log = tmp_path / "results" / f"img-fails.slurm-{job_id}.out"
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "1:0"), log.read_text()[-3000:]
    assert json.loads((tmp_path / "results" / "img-fails" / "verdict.json").read_text())["verdict"] == "FAIL"
    assert _containers("img-fails") == []


@pytest.mark.docker
def test_slurm_stop_of_an_image_job_stops_its_container(slurm_cluster, bigmem_image, tmp_path):
    """scancel sends the batch script SIGTERM; its trap stops the container, which Docker, not the job,
    holds: nothing of the job runs on after it ends CANCELLED, and the run directory stays."""
    job = write_tiny_job(tmp_path / "job.yaml", epochs=200)
    done = submit(slurm_cluster, job, "img-stop", "--image", bigmem_image)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    try:
        wait_for(slurm_cluster, job_id, {"RUNNING"}, 60)
        deadline = time.monotonic() + 180
        while not (tmp_path / "results" / "img-stop" / "progress.json").exists():
            assert time.monotonic() < deadline, (
                tmp_path / "results" / f"img-stop.slurm-{job_id}.out"
            ).read_text()
            time.sleep(1)
        assert len(_containers("img-stop")) == 1
        stop = bigmem_train(slurm_cluster, tmp_path, "slurm", "stop", "img-stop")
        assert stop.stdout.startswith(f"img-stop: Slurm job {job_id} cancelled (CANCELLED)"), stop
        deadline = time.monotonic() + 30
        while _containers("img-stop"):
            assert time.monotonic() < deadline, "the container runs on after its job was cancelled"
            time.sleep(1)
        assert (tmp_path / "results" / "img-stop" / "checkpoints").is_dir()
    finally:
        subprocess.run(["scancel", job_id], env=slurm_cluster.env, check=False)
        subprocess.run(["docker", "rm", "-f", "img-stop"], capture_output=True, check=False)


@pytest.mark.docker
def test_an_image_docker_does_not_know_is_one_line_and_submits_nothing(
    slurm_cluster, docker_daemon, tmp_path
):
    job = write_tiny_job(tmp_path / "job.yaml")
    before = job_ids(slurm_cluster)
    done = submit(slurm_cluster, job, "img-bad", "--image", "bigmem-train:no-such-tag")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--image bigmem-train:no-such-tag: Docker on this host has no such image" in done.stderr
    assert job_ids(slurm_cluster) == before and not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "case, extra, message",
    [
        (
            "partition",
            ["--partition", "nowhere"],
            "--partition nowhere: no such partition (sinfo shows: bigmem)",
        ),
        ("nodes", ["--nodes", "2"], "--nodes 2: partition bigmem has 1 node(s)"),
        ("time", ["--time", "1h"], "--time '1h': not a Slurm time"),
        ("no client", [], "sinfo not found: is the Slurm client (slurm-client) installed"),
        ("no controller", [], "sinfo -h: slurm_load_partitions: Unable to contact slurm controller"),
    ],
    ids=["partition", "nodes", "time", "no client", "no controller"],
)
def test_bad_input_is_one_line_and_submits_nothing(slurm_cluster, tmp_path, case, extra, message):
    job = write_tiny_job(tmp_path / "job.yaml", strategy="multi_worker" if case == "nodes" else "single")
    env = dict(slurm_cluster.env)
    if case == "no client":
        env["PATH"] = str(bigmem_train_executable().parent)
    if case == "no controller":  # the cluster's own config, its controller's port closed
        conf = tmp_path / "slurm.conf"
        conf.write_text(
            re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={free_port()}", slurm_cluster.conf.read_text())
        )
        env["SLURM_CONF"] = str(conf)
    before = job_ids(slurm_cluster)
    done = submit(slurm_cluster, job, "bad", *extra, env=env)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["job.yaml", "slurm.conf"][: 2 if case == "no controller" else 1]
    )
    assert job_ids(slurm_cluster) == before


def test_every_time_submit_accepts_sbatch_accepts(slurm_cluster):
    """submit is never more lenient than Slurm: of these, each --time that check_time lets through, sbatch
    takes (sbatch also takes some check_time refuses, e.g. "1-" and "-5", which sbatch(1) does not list)."""
    accepted = []
    for text in [*ACCEPTED_TIMES, "", "1h", "1:2:3:4", "1-2-3", "12:60x", "1.5", "1-12:30:15:1", "2 days"]:
        try:
            check_time(text)
        except BadInput:
            continue
        accepted.append(text)
        done = subprocess.run(
            ["sbatch", "--test-only", f"--time={text}", "--wrap=true"],
            env=slurm_cluster.env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, (text, done.stderr)
    assert accepted == ACCEPTED_TIMES


def test_a_job_slurm_kills_for_memory_is_named_by_validate(slurm_cluster_over_memory_kill, tmp_path):
    """The batch script ``submit --dry-run`` renders, its --mem lowered (submit itself always asks for the
    plan), sent with sbatch; slurmstepd kills it (Slurm 22.05 leaves it FAILED, ExitCode 0:9) and says so in
    the job's output file, where validate reads it."""
    cluster = slurm_cluster_over_memory_kill
    job = write_tiny_job(tmp_path / "job.yaml", epochs=200)
    dry = submit(cluster, job, "oom", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    script = "\n".join(dry.stdout.splitlines()[:-1]) + "\n"  # the last line is the plan, not the script's
    script, lowered = re.subn(r"(?m)^#SBATCH --mem=\d+M$", f"#SBATCH --mem={KILL_MEM_MIB}M", script)
    assert lowered == 1, script
    (tmp_path / "results").mkdir()  # submit makes the folder of the job's output before sbatch
    sent = subprocess.run(
        ["sbatch", "--parsable"], input=script, env=cluster.env, cwd=tmp_path, capture_output=True, text=True
    )
    assert sent.returncode == 0, sent.stderr
    job_id = sent.stdout.strip()
    ended = wait_for(cluster, job_id, SLURM_ENDED, 150)
    log = tmp_path / "results" / f"oom.slurm-{job_id}.out"
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "0:9"), log.read_text()[-3000:]
    run_dir = tmp_path / "results" / "oom"
    state = json.loads((run_dir / "state.json").read_text())
    assert state["state"] == "running" and state["slurm"] == {
        "job_id": job_id,
        "cluster": "bigmemtest",
        "mem_mib": KILL_MEM_MIB,
    }
    validated = bigmem_train(cluster, tmp_path, "validate", str(run_dir))
    assert validated.returncode == 1, validated.stdout + validated.stderr
    finished = next(line for line in validated.stdout.splitlines() if "] finished: " in line)
    assert re.fullmatch(
        rf"  \[FAIL\] finished: killed by Slurm for memory at about \d+\.\d\d GiB \(job {job_id} FAILED, "
        rf"--mem {KILL_MEM_MIB}M; planned \d+\.\d\d GiB\) \(scontrol says job {job_id} FAILED, ExitCode 0:9; "
        rf"the job's output file says 'StepId={job_id}\.batch exceeded memory limit \(\d+ > "
        rf"{KILL_MEM_MIB * 2**20}\), being killed'\); 0 of 200 epochs finished",
        finished,
    ), finished


def test_a_multi_worker_job_on_two_nodes_runs_a_worker_on_each_and_passes(
    slurm_cluster_two_nodes, tmp_path, monkeypatch
):
    """srun starts one worker per node; each builds its TF_CONFIG from Slurm's environment (the nodes at their
    NodeAddr, in two network namespaces), the two train in lockstep, and the chief validates. Both write to the
    one results folder, as nodes sharing it would: the chief its run directory, worker 1 its own."""
    cluster = slurm_cluster_two_nodes
    # 12 cases: 8 training, 4 validation, global batch 2 (one sample per worker and step).
    job = write_tiny_job(tmp_path / "job.yaml", epochs=2, strategy="multi_worker", cases=12)
    done = submit(cluster, job, "two", "--nodes", "2", "--time", "10:00")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    ended = wait_for(cluster, job_id, SLURM_ENDED, 240)
    log = tmp_path / "results" / f"two.slurm-{job_id}.out"
    text = log.read_text()
    assert ended["JobState"] == "COMPLETED" and ended["ExitCode"] == "0:0", text[-4000:]
    # Two nodes, a worker on each, each node asked for one worker's plan (half the global batch).
    assert (ended["NumNodes"], ended["NodeList"]) == ("2", "n[1-2]"), ended
    request = _worker_request_mib(job, 2, monkeypatch)
    assert request < _request_mib(job) and ended["MinMemoryNode"] == f"{request}M", ended
    assert ended["TRES"].startswith(f"cpu=2,mem={2 * request}M,node=2"), ended
    # srun --label: each line of the log names the worker that wrote it.
    for index in (0, 1):
        assert f"{index}: bigmem-train: run directory " in text, text[-4000:]
    assert re.search(r"(?m)^0: .*PASS", text) and re.search(r"(?m)^1: TRAINED ", text), text[-4000:]
    chief, worker = tmp_path / "results" / "two", tmp_path / "results" / "two.worker1"
    assert json.loads((chief / "verdict.json").read_text())["verdict"] == "PASS"
    assert not (worker / "verdict.json").exists(), "only the chief validates and reports"
    for run in (chief, worker):
        assert json.loads((run / "state.json").read_text())["state"] == "finished"
        metrics = json.loads((run / "metrics.json").read_text())
        assert (metrics["strategy"], metrics["workers"]) == ("multi_worker", 2), metrics
        assert json.loads((run / "state.json").read_text())["slurm"]["job_id"] == job_id
    assert (chief / "history.csv").read_text() == (worker / "history.csv").read_text()
    status = bigmem_train(cluster, tmp_path, "slurm", "status", "two").stdout.splitlines()
    assert (
        status[0] == f"two: Slurm job {job_id} COMPLETED on n1, exit code 0" and "  verdict: PASS" in status
    )


def test_a_multi_worker_job_that_fails_validation_ends_failed_and_is_not_trained_again(
    slurm_cluster_two_nodes, tmp_path
):
    """Two workers, a Dice floor no run reaches: both train to the end, the chief's verdict fails, and the
    job ends FAILED with ExitCode 1:0: the chief's verdict, even where srun stops the other worker while it is
    still leaving (a loaded cold run of the suite: srun's own code read 137:0). Submitted again under its name
    it is refused by the finished run (exit 2), not trained again; the exit codes' folder is gone after each
    job."""
    cluster = slurm_cluster_two_nodes
    job = write_tiny_job(tmp_path / "job.yaml", epochs=1, strategy="multi_worker", cases=12)
    floor = ["--nodes", "2", "--set", "validation.dice_floor=1.0"]
    done = submit(cluster, job, "two-fails", *floor)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    ended = wait_for(cluster, job_id, SLURM_ENDED, 240)
    text = (tmp_path / "results" / f"two-fails.slurm-{job_id}.out").read_text()
    assert (ended["JobState"], ended["ExitCode"], ended["NumNodes"]) == ("FAILED", "1:0", "2"), text[-4000:]
    chief = tmp_path / "results" / "two-fails"
    assert json.loads((chief / "verdict.json").read_text())["verdict"] == "FAIL"
    assert re.search(r"(?m)^1: TRAINED ", text), text[-4000:]
    assert not list((tmp_path / "results").glob(".two-fails.slurm-exit-*"))
    again = submit(cluster, job, "two-fails", *floor)
    assert again.returncode == 0, again.stderr
    second = again.stdout.strip()
    ended = wait_for(cluster, second, SLURM_ENDED, 240)
    text = (tmp_path / "results" / f"two-fails.slurm-{second}.out").read_text()
    # The first worker to refuse exits 2 and srun (--kill-on-bad-exit) stops the other: the job's code is the
    # refusal's, whichever worker it was (srun's own, the highest of its tasks', could read 143 or 137).
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "2:0"), (ended, text[-4000:])
    assert "already finished; choose another --run-name" in text, text[-4000:]
    assert not list((tmp_path / "results").glob(".two-fails.slurm-exit-*"))


def test_each_task_of_a_two_node_step_gets_its_own_tf_config(slurm_cluster_two_nodes, tmp_path):
    """`slurm tf-config` in each task of `srun --nodes 2 --ntasks-per-node 1`: the same cluster, the nodes at
    their NodeAddr and one port from the job id, and the task's own index."""
    cluster = slurm_cluster_two_nodes
    done = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "--mem=50M", "--label"]
        + [str(bigmem_train_executable()), "slurm", "tf-config"],
        env={**cluster.env, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    by_task = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    configs = [json.loads(by_task[str(index)]) for index in (0, 1)]
    workers = configs[0]["cluster"]["worker"]
    port = int(workers[0].rsplit(":", 1)[1])
    assert workers == [f"{NETWORK}.11:{port}", f"{NETWORK}.12:{port}"] and 20000 <= port < 30000
    assert [config["task"] for config in configs] == [{"type": "worker", "index": i} for i in (0, 1)]
    assert configs[1]["cluster"] == configs[0]["cluster"]


def _job_cgroup(job_id: str) -> Path:
    """The v1 memory cgroup Slurm's task/cgroup made for job ``job_id`` (slurm_NODE/uid_U/job_N)."""
    found = sorted(Path("/sys/fs/cgroup/memory").glob(f"slurm*/uid_*/job_{job_id}"))
    assert len(found) == 1, found
    return found[0]


def test_under_cgroup_enforcement_the_planned_mem_holds_the_job_and_it_passes(slurm_cluster_cgroup, tmp_path):
    """The bigmem_slurm role's enforcement (the job in a memory cgroup of its --mem): the kit's job, asked for
    with its plan, runs inside that limit, its preflight and memory guard see the limit and let it run, and it
    passes."""
    cluster = slurm_cluster_cgroup
    job = write_tiny_job(tmp_path / "job.yaml")
    done = submit(cluster, job, "held", "--time", "10:00")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    request = _request_mib(job)
    ended = wait_for(cluster, job_id, SLURM_ENDED, 150)
    log = tmp_path / "results" / f"held.slurm-{job_id}.out"
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text()[-3000:]
    assert ended["MinMemoryNode"] == f"{request}M"
    run = tmp_path / "results" / "held"
    assert json.loads((run / "verdict.json").read_text())["verdict"] == "PASS"
    # The run measured itself inside the job's cgroup, whose limit is the --mem asked for.
    cgroup = json.loads((run / "state.json").read_text())["cgroup"]
    assert (cgroup["version"], cgroup["limit_bytes"]) == (1, request * 2**20), cgroup
    peak = max(int(row["working_set_bytes"]) for row in _memory_rows(run))
    assert 0 < peak < request * 2**20


def _memory_rows(run: Path) -> list[dict[str, str]]:
    import csv

    with open(run / "memory.csv", newline="") as handle:
        return [row for row in csv.DictReader(handle) if row.get("working_set_bytes")]


def test_under_cgroup_enforcement_a_mem_below_the_plan_is_refused_by_the_job_at_once(
    slurm_cluster_cgroup, tmp_path
):
    """The batch script with its --mem lowered by hand below the plan: the job's preflight reads the cgroup's
    limit and refuses (exit 3, one line naming the limit) before TensorFlow trains, instead of being killed."""
    cluster = slurm_cluster_cgroup
    job = write_tiny_job(tmp_path / "job.yaml")
    job_id = _sbatch_lowered(cluster, job, "small", KILL_MEM_MIB + 200, tmp_path)
    ended = wait_for(cluster, job_id, SLURM_ENDED, 150)
    text = (tmp_path / "results" / f"small.slurm-{job_id}.out").read_text()
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "3:0"), text[-3000:]
    assert f"usable (the cgroup v1 memory limit {(KILL_MEM_MIB + 200) * 2**20} B" in text, text[-3000:]


def _sbatch_lowered(cluster, job: Path, name: str, mem_mib: int, folder: Path, *extra: str) -> str:
    """``submit --dry-run``'s batch script with its --mem set to ``mem_mib``, sent with sbatch: its job id."""
    dry = submit(cluster, job, name, "--dry-run", *extra)
    assert dry.returncode == 0, dry.stderr
    script = "\n".join(dry.stdout.splitlines()[:-1]) + "\n"  # the last line is the plan, not the script's
    script, lowered = re.subn(r"(?m)^#SBATCH --mem=\d+M$", f"#SBATCH --mem={mem_mib}M", script)
    assert lowered == 1, script
    (folder / "results").mkdir(exist_ok=True)
    sent = subprocess.run(
        ["sbatch", "--parsable"], input=script, env=cluster.env, cwd=folder, capture_output=True, text=True
    )
    assert sent.returncode == 0, sent.stderr
    return sent.stdout.strip()


def test_under_cgroup_enforcement_a_job_that_outgrows_its_limit_ends_out_of_memory_and_validate_says_so(
    slurm_cluster_cgroup, tmp_path
):
    """A job that grows past its cgroup's limit is killed by the kernel and Slurm ends it OUT_OF_MEMORY. A
    planned job stays under its limit, so the test makes one outgrow it: once the job has started, its cgroup's
    limit is lowered to just above what it holds (what a leak, or a plan far off, would reach), with the
    memory guard off (guard.enabled false, a user's choice; with it on, the guard stops the job cleanly
    first). validate then names Slurm's kill, at the size the run last measured."""
    cluster = slurm_cluster_cgroup
    job = write_tiny_job(tmp_path / "job.yaml", epochs=200)
    done = submit(cluster, job, "outgrown", "--set", "guard.enabled=false")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    run = tmp_path / "results" / "outgrown"
    # Once the run has measured itself (a row in memory.csv), so that validate has a size to name.
    deadline = time.monotonic() + 120
    while not (run / "memory.csv").exists() or not _memory_rows(run):
        assert time.monotonic() < deadline and cluster.job(job_id).get("JobState") in ("PENDING", "RUNNING")
        time.sleep(0.2)
    cgroup = _job_cgroup(job_id)
    for _ in range(20):  # a limit below what the cgroup holds is refused (EBUSY): aim above it
        usage = int((cgroup / "memory.usage_in_bytes").read_text())
        try:
            (cgroup / "memory.limit_in_bytes").write_text(str(usage + 16 * 2**20))
            break
        except OSError:
            time.sleep(0.1)
    ended = wait_for(cluster, job_id, SLURM_ENDED, 150)
    log = tmp_path / "results" / f"outgrown.slurm-{job_id}.out"
    assert ended["JobState"] == "OUT_OF_MEMORY", (ended, log.read_text()[-3000:])
    validated = bigmem_train(cluster, tmp_path, "validate", str(run))
    assert validated.returncode == 1, validated.stdout + validated.stderr
    finished = next(line for line in validated.stdout.splitlines() if "] finished: " in line)
    request = _request_mib(job)
    # Slurm's word is the evidence: the job's cgroup, and the OOM counter in it, went with the job.
    assert re.fullmatch(
        rf"  \[FAIL\] finished: killed by Slurm for memory at about \d+\.\d\d GiB \(job {job_id} OUT_OF_MEMORY, "
        rf"--mem {request}M; planned \d+\.\d\d GiB; cgroup v1 limit \d+\.\d\d GiB\) \(scontrol says job "
        rf"{job_id} OUT_OF_MEMORY, ExitCode \d+:\d+\); \d+ of 200 epochs finished",
        finished,
    ), finished
