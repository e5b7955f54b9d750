"""``bigmem-train submit`` without Slurm: the batch script's --mem is the plan's envelope peak rounded up to
MiB, --time is checked, a plan larger than the partition's nodes is refused (exit 3), and --dry-run
submits nothing; a multi_worker job on N nodes gets one worker per node from srun, --mem one worker's plan,
and each worker's TF_CONFIG from Slurm's environment (``slurm tf-config``). With ``--image`` the script runs
the job's hardened `docker run` in the foreground, stops the container on SIGTERM and exits with its exit
code (run with a stand-in for docker). ``sinfo``, ``sbatch``, ``scontrol`` and ``docker image inspect`` are
stand-ins (``scheduler.run_client`` replaced)."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import read_host_facts
from bigmem_train.memory.plan import plan_job
from bigmem_train.ops import scheduler
from bigmem_train.ops.distribute import parse_tf_config
from bigmem_train.ops.remote import HARDENED_DOCKER_FLAGS
from tests.fixtures.common import write_tiny_job


def _plan(job, overrides=None):
    return plan_job(load_config(str(job), overrides or {}, {}), read_host_facts(), to_run_here=False)


class StandInSlurm:
    """A stand-in for sinfo and sbatch: one partition of ``nodes`` nodes of ``memory_mib`` (or of the
    ``node_memories`` given, one per node); records every call."""

    def __init__(
        self,
        memory_mib: int,
        partition: str = "bigmem",
        cpus: int = 64,
        job_id: str = "4242",
        nodes: int = 2,
        images: tuple[str, ...] = (),
        node_memories: tuple[int, ...] | None = None,
    ):
        self.memory_mib, self.partition, self.cpus, self.job_id = memory_mib, partition, cpus, job_id
        self.node_memories = node_memories or (memory_mib,) * nodes
        self.images = images
        self.calls: list[list[str]] = []
        self.scripts: list[str] = []

    def __call__(self, command, **options):
        self.calls.append(command)
        if command[0] == "sinfo":
            if command[-1] == "%P":
                lines = f"{self.partition}*\n"  # sinfo marks the default partition
            else:
                assert command[:5] == ["sinfo", "-h", "-N", "-o", "%N %P %m %c"], command
                # sinfo -N: a line per node, its name, partition, RealMemory and CPUs.
                lines = "".join(
                    f"node{index} {self.partition}* {memory} {self.cpus}\n"
                    for index, memory in enumerate(self.node_memories, 1)
                )
            if "-p" in command and command[command.index("-p") + 1] != self.partition:
                lines = ""
            return subprocess.CompletedProcess(command, 0, lines, "")
        if command[0] == "sbatch":
            self.scripts.append(options["input"])
            return subprocess.CompletedProcess(command, 0, f"{self.job_id}\n", "")
        if command[:3] == ["docker", "image", "inspect"]:
            if command[-1] in self.images:
                return subprocess.CompletedProcess(command, 0, "sha256:0123\n", "")
            return subprocess.CompletedProcess(command, 1, "[]\n", f"Error: No such image: {command[-1]}\n")
        raise AssertionError(f"unexpected command {command}")


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_job(tmp_path / "job.yaml", results=tmp_path / "results")


@pytest.mark.parametrize(
    "text", ["30", "30:00", "2:30:00", "1-12", "1-12:30", "1-12:30:15", "UNLIMITED", "unlimited"]
)
def test_slurm_time_formats_are_accepted(text):
    assert scheduler.check_time(text) == text


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "1-", "-5", "1-2-3", "12:60x", "1.5"])
def test_other_times_are_bad_input(text):
    with pytest.raises(BadInput, match="not a Slurm time"):
        scheduler.check_time(text)


def test_dry_run_script_requests_the_plan_rounded_up_to_mib_and_submits_nothing(
    tiny, tmp_path, monkeypatch, capsys
):
    stand_in = StandInSlurm(memory_mib=64 * 1024)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    code = main(["submit", "--config", str(tiny), "--run-name", "s1", "--time", "0-01:00", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    expected = math.ceil(_plan(tiny).peak_bytes * 1.03 / 0.97 / 2**20)  # independent of the renderer
    assert f"#SBATCH --mem={expected}M\n" in out
    assert "#SBATCH --partition=bigmem\n" in out
    assert "#SBATCH --time=0-01:00\n" in out
    assert "#SBATCH --job-name=s1\n" in out
    assert f'#SBATCH --output="{tmp_path / "results" / "s1.slurm-%j.out"}"\n' in out
    assert f'#SBATCH --chdir="{tmp_path}"\n' in out
    assert f"run --config {tiny} --results {tmp_path / 'results'} --run-name s1" in out
    assert out.rstrip().splitlines()[-1].startswith("plan: peak ")
    assert f"--mem={expected}M" in out.rstrip().splitlines()[-1]
    assert all(call[0] != "sbatch" for call in stand_in.calls)
    assert not (tmp_path / "results").exists()


def test_submit_sends_the_script_to_sbatch_and_prints_the_job_id(tiny, tmp_path, monkeypatch, capsys):
    stand_in = StandInSlurm(memory_mib=64 * 1024, cpus=4)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    assert (
        main(["submit", "--config", str(tiny), "--run-name", "s2", "--set", "runtime.intra_op_threads=3"])
        == 0
    )
    assert capsys.readouterr().out.strip() == "4242"
    (script,) = stand_in.scripts
    assert "#SBATCH --cpus-per-task=3\n" in script
    assert "--time" not in script.split("exec")[0]  # the partition's default
    assert "--set runtime.intra_op_threads=3" in script
    assert (tmp_path / "results").is_dir() and not (tmp_path / "results" / "s2").exists()


def test_a_plan_larger_than_the_partitions_nodes_does_not_fit(tiny, tmp_path, monkeypatch, capsys):
    request = math.ceil(_plan(tiny).peak_bytes * 1.03 / 0.97 / 2**20)
    stand_in = StandInSlurm(memory_mib=request - 1)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--run-name", "s3"]) == 3
    err = capsys.readouterr().err
    assert f"--mem={request}M) does not fit partition bigmem" in err
    assert f"RealMemory {request - 1}M" in err
    assert all(call[0] != "sbatch" for call in stand_in.calls)


def test_a_partition_of_unequal_nodes_holds_a_job_where_enough_of_its_nodes_do(
    tiny, tmp_path, monkeypatch, capsys
):
    """A partition of one large and one small node: a one-node job fits (Slurm starts it on the large one), a
    two-node job does not (it would wait for ever for a second node that can hold one worker), and with two
    large nodes of three it fits."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    one = math.ceil(_plan(tiny).peak_bytes * 1.03 / 0.97 / 2**20)
    unequal = StandInSlurm(memory_mib=0, node_memories=(one, one - 1))
    monkeypatch.setattr(scheduler, "run_client", unequal)
    assert main(["submit", "--config", str(tiny), "--run-name", "u1", "--dry-run"]) == 0
    capsys.readouterr()
    # Two workers: each node is asked for one worker's plan; make the small node too small for that too.
    argv = ["submit", "--config", str(tiny), "--set", "training.strategy=multi_worker", "--nodes", "2"]
    two_workers = '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}'
    monkeypatch.setenv("TF_CONFIG", two_workers)
    worker = math.ceil(_plan(tiny, {"training.strategy": "multi_worker"}).peak_bytes * 1.03 / 0.97 / 2**20)
    monkeypatch.delenv("TF_CONFIG")
    small = StandInSlurm(memory_mib=0, node_memories=(worker, worker - 1))
    monkeypatch.setattr(scheduler, "run_client", small)
    assert main([*argv, "--run-name", "u2"]) == 3
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"bigmem-train: error: the plan ({err.split('the plan (')[1].split(', --mem')[0]}, --mem={worker}M per "
        f"node) fits 1 of partition bigmem's 2 nodes, and --nodes 2 needs 2 (RealMemory of its nodes: "
        f"{worker}M, {worker - 1}M)"
    ]
    assert all(call[0] != "sbatch" for call in small.calls)
    monkeypatch.setattr(
        scheduler, "run_client", StandInSlurm(memory_mib=0, node_memories=(worker, 1, worker))
    )
    assert main([*argv, "--run-name", "u3", "--dry-run"]) == 0


def test_a_plan_of_exactly_the_nodes_memory_fits(tiny, tmp_path, monkeypatch):
    request = math.ceil(_plan(tiny).peak_bytes * 1.03 / 0.97 / 2**20)
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=request))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--run-name", "s4", "--dry-run"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--partition", "gpu"], "--partition gpu: no such partition (sinfo shows: bigmem)"),
        (["--time", "2h"], "--time '2h': not a Slurm time"),
        (
            ["--nodes", "3", "--set", "training.strategy=multi_worker"],
            "--nodes 3: partition bigmem has 2 node(s)",
        ),
        (
            ["--nodes", "2", "--set", "training.strategy=multi_worker", "--set", "training.batch_size=3"],
            "training.batch_size 3 must be divisible by the 2 workers",
        ),
    ],
)
def test_bad_input_is_one_line_and_submits_nothing(tiny, tmp_path, monkeypatch, capsys, argv, message):
    stand_in = StandInSlurm(memory_mib=64 * 1024)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert all(call[0] != "sbatch" for call in stand_in.calls)


def test_a_multi_worker_job_on_two_nodes_runs_one_worker_per_node_with_one_workers_plan(
    tiny, tmp_path, monkeypatch, capsys
):
    """--mem is the plan of one worker (half the global batch), computed here as `run` plans it on each node:
    with a TF_CONFIG of two workers; srun starts the workers, each with its TF_CONFIG from Slurm."""
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=64 * 1024, nodes=2))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    argv = ["submit", "--config", str(tiny), "--run-name", "mw", "--set", "training.strategy=multi_worker"]
    assert main([*argv, "--nodes", "2", "--set", "runtime.intra_op_threads=3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "TF_CONFIG" not in os.environ  # submit plans the workers without setting TF_CONFIG
    two_workers = '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}'
    monkeypatch.setenv("TF_CONFIG", two_workers)
    per_worker = _plan(tiny, {"training.strategy": "multi_worker"})
    monkeypatch.delenv("TF_CONFIG")
    whole = _plan(tiny, {"training.strategy": "multi_worker"})
    assert per_worker.workers == 2 and per_worker.peak_bytes < whole.peak_bytes
    expected = math.ceil(per_worker.peak_bytes * 1.03 / 0.97 / 2**20)
    script, plan = out.rstrip().rsplit("\n", 1)
    lines = script.splitlines()
    assert [line for line in lines if line.startswith("#SBATCH --n")] == [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
    ]
    assert f"#SBATCH --mem={expected}M" in lines and "#SBATCH --cpus-per-task=3" in lines
    assert plan.startswith("plan: peak ") and "batch 2 over 2 worker(s), 1 per node" in plan
    srun = script.split("\nsrun ", 1)[1].replace("\\\n", " ").split(" || status=$?\n", 1)[0]
    words = shlex.split(srun)
    assert words[:5] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=3",
        "--kill-on-bad-exit=1",
        "--label",
    ]
    # bash -c '...' BIGMEM_TRAIN run ...: the worker sets TF_CONFIG from `slurm tf-config`, runs the job and
    # writes its exit code for the script (tests/remote/test_slurm.py runs it on real Slurm).
    assert words[5:7] == ["bash", "-c"] and '"$0" slurm tf-config' in words[7]
    assert '>"$BIGMEM_EXIT_CODES/$SLURM_PROCID"' in words[7]
    assert words[8] == str(scheduler.bigmem_train_executable()) and words[9] == "run"
    assert words[-4:] == ["--results", str(tmp_path / "results"), "--run-name", "mw"]
    # On one node too, the worker is started by srun with its TF_CONFIG: `run` needs one for multi_worker.
    assert main([*argv, "--dry-run"]) == 0
    one = capsys.readouterr().out
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n" in one and "\nsrun --nodes=1 " in one


# A stand-in for srun (named as such: no Slurm here; tests/remote/test_slurm.py runs the script on real Slurm):
# it runs the worker command line of each task in FAKE_ORDER, one after the other, as task SLURM_PROCID, or
# for a task in FAKE_KILLED does not run it (srun stopped it before it wrote anything), and exits as srun
# does, with the highest of its tasks' codes (137 for a killed one).
FAKE_SRUN = """#!/bin/bash
while [ "$1" != bash ]; do shift; done
worst=0
for task in $FAKE_ORDER; do
  if [[ " $FAKE_KILLED " == *" $task "* ]]; then code=137
  else SLURM_PROCID=$task "$@"; code=$?
  fi
  if [ "$code" -gt "$worst" ]; then worst=$code; fi
done
exit "$worst"
"""
# A stand-in for bigmem-train: `slurm tf-config` prints a TF_CONFIG, `run` exits with FAKE_CODE_<its index>.
FAKE_BIGMEM = """#!/bin/bash
if [ "$1" = slurm ]; then echo '{}'; exit 0; fi
code=FAKE_CODE_$SLURM_PROCID
exit "${!code}"
"""


@pytest.mark.parametrize(
    "order, killed, codes, expected",
    [
        # The chief's failed verdict; srun stops worker 1 while it is still leaving (a loaded run: 137:0).
        ("0 1", "1", {"0": "1"}, 1),
        # Worker 1 refuses first (bad input) and srun stops the chief before it says anything.
        ("1 0", "0", {"1": "2"}, 2),
        ("1 0", "", {"0": "0", "1": "0"}, 0),
        # Worker 1 leaves first with 0, then the chief does not fit.
        ("1 0", "", {"0": "3", "1": "0"}, 3),
    ],
)
def test_a_multi_worker_jobs_exit_code_is_the_chiefs_else_the_first_worker_to_end_by_itself(
    tiny, tmp_path, monkeypatch, capsys, order, killed, codes, expected
):
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("bigmem-train", FAKE_BIGMEM)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=64 * 1024, nodes=2))
    monkeypatch.setattr(scheduler, "bigmem_train_executable", lambda: tools / "bigmem-train")
    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--config", str(tiny), "--run-name", "mw", "--set", "training.strategy=multi_worker"]
    assert main([*argv, "--nodes", "2", "--dry-run"]) == 0
    script = capsys.readouterr().out.rstrip().rsplit("\n", 1)[0]  # less the plan line after it
    environment = {
        "PATH": f"{tools}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "FAKE_ORDER": order,
        "FAKE_KILLED": killed,
        **{f"FAKE_CODE_{task}": code for task, code in codes.items()},
    }
    done = subprocess.run(["bash", "-c", script], env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == expected, done.stderr
    # The workers' codes were written beside the log, and the script removed them.
    assert not list((tmp_path / "results").glob(".mw.slurm-exit-*"))


def test_a_single_job_on_one_node_keeps_its_one_task_script(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=64 * 1024))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--run-name", "s1", "--nodes", "1", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=" in script
    assert "srun" not in script and f"\nexec {scheduler.bigmem_train_executable()} run --config" in script


# --------------------------------------------------------------------------------------------------
# --image: the job in the kit's Docker image on the node


def _image_script(capsys, argv) -> str:
    """The batch script ``submit ARGV --dry-run`` prints (without the plan line after it)."""
    assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.rstrip().rsplit("\n", 1)[0] + "\n"


def _docker_run(script: str) -> list[str]:
    """The words of the script's `docker run ... &` line, as the shell splits them (but for $(...), ${...})."""
    (line,) = [line for line in script.splitlines() if line.startswith("docker run ")]
    assert line.endswith(" &")
    return shlex.split(line[: -len(" &")])


def _option(words: list[str], flag: str) -> list[str]:
    """Every value of ``flag`` in ``words`` (before the image)."""
    return [words[index + 1] for index, word in enumerate(words) if word == flag]


def test_an_image_job_runs_the_kits_hardened_docker_run_in_the_foreground(
    tiny, tmp_path, monkeypatch, capsys
):
    stand_in = StandInSlurm(memory_mib=64 * 1024, images=("bigmem-train", "bigmem-train:test"))
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--config", str(tiny), "--run-name", "img-1", "--set", "runtime.intra_op_threads=3"]
    script = _image_script(capsys, [*argv, "--image", "bigmem-train:test"])
    expected = math.ceil(_plan(tiny).peak_bytes * 1.03 / 0.97 / 2**20)
    assert f"#SBATCH --mem={expected}M\n" in script and "#SBATCH --ntasks=1\n" in script
    assert str(scheduler.bigmem_train_executable()) not in script
    words = _docker_run(script)
    image = words.index("bigmem-train:test")
    head, job = words[:image], words[image:]
    assert head[:2] == ["docker", "run"] and "-d" not in head and {"--rm", "--init"} <= set(head)
    assert _option(head, "--name") == ["img-1"] and _option(head, "--user") == ["$(id -u):$(id -g)"]
    joined = " ".join(head)
    assert " ".join(HARDENED_DOCKER_FLAGS) in joined and _option(head, "--network") == ["none"]
    # Mounts: the results folder writable at /results, the config file read-only; no dataset for synthetic data.
    assert _option(head, "-v") == [f"{tmp_path / 'results'}:/results", f"{tiny}:/config/job.yaml:ro"]
    # Docker's cgroup holds the container, not the job's: the job's CPUs and its --mem are its limits, with no
    # swap beyond it (the job's preflight and memory guard read that limit as they would Slurm's).
    assert _option(head, "--cpus") == ["3"]
    assert _option(head, "--memory") == [f"{expected}m"] and _option(head, "--memory-swap") == [
        f"{expected}m"
    ]
    assert _option(head, "-e") == ["SLURM_JOB_ID", "SLURM_CLUSTER_NAME", "SLURM_MEM_PER_NODE"]
    assert "${numa:+--cap-add" in head and "SYS_NICE}" in head
    assert job == [
        "bigmem-train:test",
        "run",
        "--config",
        "/config/job.yaml",
        "--set",
        "runtime.intra_op_threads=3",
        "--results",
        "/results",
        "--run-name",
        "img-1",
    ]
    assert "trap 'docker stop --time 10 img-1 >/dev/null 2>&1 || true' TERM INT\n" in script
    assert script.rstrip().endswith('exit "$status"')
    assert [call[:3] for call in stand_in.calls if call[0] == "docker"] == [["docker", "image", "inspect"]]
    # --image alone names the kit's image; --venv is today's script, the default.
    assert "bigmem-train" in _docker_run(_image_script(capsys, [*argv, "--image"]))
    assert _image_script(capsys, [*argv, "--venv"]) == _image_script(capsys, argv)


def test_an_image_jobs_dataset_is_mounted_read_only(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=64 * 1024, images=("bigmem-train",)))
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "lab data" / "Task01"
    data.mkdir(parents=True)
    argv = ["submit", "--config", "default", "--run-name", "img-2", "--image"]
    for flags in (["--data", str(data)], ["--set", "data.source=decathlon", "--set", f"data.path={data}"]):
        words = _docker_run(_image_script(capsys, [*argv, *flags]))
        assert _option(words, "-v") == [f"{tmp_path / 'results'}:/results", f"{data}:/data:ro"]
        # A preset is named, not mounted; the dataset is the container's /data whichever way it was given.
        job = words[words.index("bigmem-train") :]
        assert job[:4] == ["bigmem-train", "run", "--config", "default"] and job[-2:] == ["--data", "/data"]


def _run_script(script: str, tmp_path, exit_code: int, stop: bool = False) -> tuple[int, Path]:
    """Run the batch script with a stand-in for docker: `docker run` writes its arguments and exits with
    ``exit_code`` (with ``stop``, once `docker stop` ends it: the test sends the script SIGTERM first, as
    Slurm does when it ends a job)."""
    stub = tmp_path / "stub"
    stub.mkdir()
    docker = stub / "docker"
    docker.write_text(
        "#!/bin/bash\n"
        'case "$1" in\n'
        '  run) echo $$ > "$STUB/run.pid"; printf "%s\\n" "$@" > "$STUB/run.args"\n'
        '       if [ -n "$STUB_STOP" ]; then trap \'kill $!; exit "$STUB_EXIT"\' TERM; sleep 60 & wait; fi\n'
        '       exit "$STUB_EXIT" ;;\n'
        '  stop) echo "$@" > "$STUB/stopped"; kill -TERM "$(cat "$STUB/run.pid")" ;;\n'
        "  rm) exit 1 ;;\n"
        "esac\n"
    )
    docker.chmod(0o755)
    environment = {
        **os.environ,
        "PATH": f"{stub}:{os.environ['PATH']}",
        "STUB": str(stub),
        "STUB_EXIT": str(exit_code),
        "STUB_STOP": "1" if stop else "",
    }
    process = subprocess.Popen(["bash", "-c", script], env=environment)
    if stop:
        deadline = time.monotonic() + 20
        while not (stub / "run.pid").exists():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30), stub


@pytest.mark.parametrize("exit_code", [0, 1, 2, 3])
def test_an_image_jobs_exit_code_is_the_containers(tiny, tmp_path, monkeypatch, capsys, exit_code):
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=64 * 1024, images=("bigmem-train",)))
    monkeypatch.chdir(tmp_path)
    script = _image_script(capsys, ["submit", "--config", str(tiny), "--run-name", "img-3", "--image"])
    code, stub = _run_script(script, tmp_path, exit_code)
    assert code == exit_code
    assert (stub / "run.args").read_text().splitlines()[-2:] == ["--run-name", "img-3"]
    assert not (stub / "stopped").exists()


def test_an_image_job_ended_by_slurm_stops_its_container(tiny, tmp_path, monkeypatch, capsys):
    """Slurm ends a job (scancel, --time) with SIGTERM to the batch script: the trap runs `docker stop`, and the
    script still waits for `docker run` and exits with its code."""
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=64 * 1024, images=("bigmem-train",)))
    monkeypatch.chdir(tmp_path)
    script = _image_script(capsys, ["submit", "--config", str(tiny), "--run-name", "img-4", "--image"])
    code, stub = _run_script(script, tmp_path, 143, stop=True)
    assert (stub / "stopped").read_text().split() == ["stop", "--time", "10", "img-4"]
    assert code == 143


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--image", "bigmem-trian"], "--image bigmem-trian: Docker on this host has no such image"),
        (
            ["--image", "--set", "training.strategy=multi_worker"],
            "--image bigmem-train: a training.strategy multi_worker job runs from the venv only for now",
        ),
        (
            ["--image", "--set", "training.strategy=multi_worker", "--nodes", "2"],
            "--image bigmem-train: a training.strategy multi_worker job runs from the venv only for now",
        ),
        (
            ["--image", "--run-name", "brats 1"],
            "--run-name brats 1: with --image the run name is the container",
        ),
        (["--image", "--results", "a:b"], "the results folder"),
    ],
    ids=[
        "unknown image",
        "multi_worker",
        "multi_worker on 2 nodes",
        "not a container name",
        "colon in a path",
    ],
)
def test_image_bad_input_is_one_line_and_submits_nothing(tiny, tmp_path, monkeypatch, capsys, argv, message):
    stand_in = StandInSlurm(memory_mib=64 * 1024, images=("bigmem-train",))
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert all(call[0] != "sbatch" for call in stand_in.calls)
    if "results" not in message and "run name" not in message:
        assert all(call[0] != "sinfo" for call in stand_in.calls)  # checked before Slurm is asked


def test_image_without_a_docker_client_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    stand_in = StandInSlurm(memory_mib=64 * 1024)

    def no_docker(command, **options):
        if command[0] == "docker":
            raise FileNotFoundError(command[0])
        return stand_in(command, **options)

    monkeypatch.setattr(scheduler, "run_client", no_docker)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--image", "--run-name", "img-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--image bigmem-train: docker not found" in err
    assert stand_in.calls == [] and not (tmp_path / "results").exists()


class StandInScontrol:
    """scontrol show hostnames / show node for nodes ``addresses`` (node name -> NodeAddr)."""

    def __init__(self, addresses: dict[str, str]):
        self.addresses = addresses
        self.calls: list[list[str]] = []

    def __call__(self, command, **options):
        self.calls.append(command)
        if command[:3] == ["scontrol", "show", "hostnames"]:
            assert command[3] == "node[07-08]"
            return subprocess.CompletedProcess(command, 0, "node07\nnode08\n", "")
        if command[:4] == ["scontrol", "show", "node", "-o"]:
            lines = "".join(
                f"NodeName={name} Arch=x86_64 NodeAddr={self.addresses[name]} NodeHostName={name} State=MIXED\n"
                for name in command[4].split(",")
            )
            return subprocess.CompletedProcess(command, 0, lines, "")
        raise AssertionError(f"unexpected command {command}")


def _task(rank: int, **changes: str) -> dict[str, str]:
    """Slurm's environment in task ``rank`` of `srun --ntasks-per-node=1` on two nodes, job 31337."""
    return {
        "SLURM_JOB_ID": "31337",
        "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(rank),
    } | changes


def test_a_workers_tf_config_comes_from_slurms_environment(monkeypatch, capsys):
    stand_in = StandInScontrol({"node07": "10.1.0.7", "node08": "node08"})
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    port = 20000 + 31337 % 10000
    for rank in (0, 1):
        cluster = parse_tf_config(scheduler.slurm_tf_config(_task(rank)))
        # Each node at its NodeAddr (the name where slurm.conf sets none), one port per job.
        assert cluster.workers == (f"10.1.0.7:{port}", f"node08:{port}")
        assert (cluster.task_type, cluster.index, cluster.is_chief) == ("worker", rank, rank == 0)
    for name, value in _task(1).items():
        monkeypatch.setenv(name, value)
    assert main(["slurm", "tf-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {
        "cluster": {"worker": [f"10.1.0.7:{port}", f"node08:{port}"]},
        "task": {"type": "worker", "index": 1},
    }


@pytest.mark.parametrize(
    "environment, message",
    [
        ({}, "SLURM_JOB_ID, SLURM_STEP_NUM_TASKS, SLURM_PROCID, SLURM_NODEID, SLURM_STEP_NODELIST not set"),
        (_task(0, SLURM_PROCID=""), "SLURM_PROCID not set: run it in a task that srun starts"),
        (_task(1, SLURM_STEP_NUM_TASKS="4", SLURM_NODEID="0"), "task 1 of 4 on node 0 of node[07-08]"),
    ],
    ids=["outside a job", "outside a step", "two tasks per node"],
)
def test_a_tf_config_outside_one_task_per_node_is_one_line(monkeypatch, capsys, environment, message):
    monkeypatch.setattr(scheduler, "run_client", StandInScontrol({"node07": "node07", "node08": "node08"}))
    for name in _task(0):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main(["slurm", "tf-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_missing_or_silent_slurm_is_bad_input(tiny, tmp_path, monkeypatch, capsys):
    def missing(command, **options):
        raise FileNotFoundError(command[0])

    def silent(command, **options):
        raise subprocess.TimeoutExpired(command, options["timeout"])

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(scheduler, "run_client", missing)
    assert main(["submit", "--config", str(tiny), "--dry-run"]) == 2
    assert "sinfo not found" in capsys.readouterr().err
    monkeypatch.setattr(scheduler, "run_client", silent)
    assert main(["submit", "--config", str(tiny), "--dry-run"]) == 2
    assert "sinfo did not answer" in capsys.readouterr().err


def test_a_failing_sinfo_is_bad_input(tiny, tmp_path, monkeypatch, capsys):
    def refusing(command, **options):
        return subprocess.CompletedProcess(
            command, 1, "", "slurm_load_partitions: Unable to contact slurm controller\n"
        )

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(scheduler, "run_client", refusing)
    assert main(["submit", "--config", str(tiny)]) == 2
    assert "Unable to contact slurm controller" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "2"], "--nodes 2: training.strategy is single, which trains on one node"),
        (["--nodes", "0"], "--nodes 0: give 1 or more"),
    ],
)
def test_nodes_that_cannot_carry_the_job_are_refused_before_asking_slurm(
    tiny, tmp_path, monkeypatch, capsys, argv, message
):
    stand_in = StandInSlurm(memory_mib=64 * 1024, nodes=4)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert stand_in.calls == []


def test_no_slurm_client_on_the_path_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    """The real client runner, with a PATH where no sinfo is: the FileNotFoundError a missing Slurm gives."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--run-name", "s5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sinfo not found: is the Slurm client (slurm-client) installed" in err
    assert not (tmp_path / "results").exists()


def test_a_path_sbatch_cannot_quote_is_bad_input(tmp_path, monkeypatch, capsys):
    folder = tmp_path / 'say "hi"'
    folder.mkdir()
    job = write_tiny_job(folder / "job.yaml", results=folder / "results")
    stand_in = StandInSlurm(memory_mib=64 * 1024)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(folder)
    assert main(["submit", "--config", str(job), "--run-name", "s6"]) == 2
    assert "a path with a double quote or a newline cannot go into an #SBATCH line" in capsys.readouterr().err
    assert all(call[0] != "sbatch" for call in stand_in.calls)


# --------------------------------------------------------------------------------------------------
# bigmem-train slurm status|logs|stop|fetch, against stand-ins for scontrol, squeue and scancel


class StandInJobs:
    """Slurm's job commands over ``jobs`` (job id -> fields); scancel marks a job CANCELLED."""

    def __init__(self, jobs: dict[str, dict[str, str]]):
        self.jobs = jobs
        self.calls: list[list[str]] = []

    def __call__(self, command, **options):
        self.calls.append(command)
        if command[:3] == ["scontrol", "show", "job"]:
            fields = self.jobs.get(command[3])
            if fields is None:
                return subprocess.CompletedProcess(
                    command, 1, "", "slurm_load_jobs error: Invalid job id specified\n"
                )
            # scontrol's layout: most fields several to a line, paths alone on theirs (with their spaces).
            alone = {key: value for key, value in fields.items() if key in {"StdOut", "WorkDir"}}
            rest = " ".join(f"{key}={value}" for key, value in fields.items() if key not in alone)
            text = f"JobId={command[3]} {rest}\n" + "".join(f"   {k}={v}\n" for k, v in alone.items())
            return subprocess.CompletedProcess(command, 0, text, "")
        if command[0] == "squeue":
            name = command[command.index("--name") + 1]
            ids = [job_id for job_id, fields in self.jobs.items() if fields["JobName"] == name]
            return subprocess.CompletedProcess(command, 0, "".join(f"{i}\n" for i in ids), "")
        if command[0] == "scancel":
            self.jobs[command[1]].update(JobState="CANCELLED", ExitCode="0:15")
            return subprocess.CompletedProcess(command, 0, "", "")
        raise AssertionError(f"unexpected command {command}")


def _slurm_job(results, name, job_id, state="RUNNING", exit_code="0:0"):
    return {
        "JobName": name,
        "JobState": state,
        "Reason": "None",
        "ExitCode": exit_code,
        "BatchHost": "node1",
        "StdOut": str(results / f"{name}.slurm-{job_id}.out"),
    }


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """A results folder with a space in its name holding run brats-1's files, as a job writes them."""
    results = tmp_path / "shared results"
    run = results / "brats-1"
    (run / "backup").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.keras").write_text("weights")
    (run / "backup" / "chief").write_text("transient")
    (run / "state.json").write_text('{"state": "running"}')
    (run / "config.yaml").write_text("training:\n  epochs: 5\n")
    (run / "progress.json").write_text('{"epoch": 2, "step": 3, "steps_per_epoch": 4}')
    (run / "history.csv").write_text("epoch,loss,val_dice\n0,0.9,0.2\n1,0.7,0.4\n")
    (run / "memory.csv").write_text("time,rss_bytes\n0,1000\n1,3000\n2,2000\n")
    (results / "brats-1.slurm-7.out").write_text("".join(f"line {n}\n" for n in range(10)))
    monkeypatch.chdir(tmp_path)
    return results


def test_status_of_a_job_by_run_name_shows_slurms_state_and_the_runs_progress(shared, monkeypatch, capsys):
    jobs = StandInJobs({"7": _slurm_job(shared, "brats-1", "7"), "3": _slurm_job(shared, "other", "3")})
    monkeypatch.setattr(scheduler, "run_client", jobs)
    assert main(["slurm", "status", "brats-1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "brats-1: Slurm job 7 RUNNING on node1"
    assert "  epoch 3/5, step 3/4" in out
    assert "  last finished epoch 2: loss 0.7000, val_dice 0.4000" in out
    assert any(line.startswith("  memory: live 2000 B") and "peak 3000 B" in line for line in out)
    assert f"  run directory: {shared / 'brats-1'}" in out
    assert main(["slurm", "status", "7", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "RUNNING" and report["exit_code"] is None and report["epoch"] == 3


def test_status_of_an_ended_job_has_its_exit_code_and_verdict(shared, monkeypatch, capsys):
    (shared / "brats-1" / "verdict.json").write_text('{"verdict": "FAIL"}')
    job = _slurm_job(shared, "brats-1", "7", state="FAILED", exit_code="1:0") | {"Reason": "NonZeroExitCode"}
    monkeypatch.setattr(scheduler, "run_client", StandInJobs({"7": job}))
    assert main(["slurm", "status", "7"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "brats-1: Slurm job 7 FAILED (NonZeroExitCode) on node1, exit code 1"
    assert "  verdict: FAIL" in out and any(line.startswith("  memory: live -,") for line in out)


def test_a_job_slurm_forgot_is_found_by_its_log_in_the_results_folder(shared, monkeypatch, capsys):
    monkeypatch.setattr(scheduler, "run_client", StandInJobs({}))
    for reference in ("7", "brats-1"):
        assert main(["slurm", "status", reference, "--results", str(shared)]) == 0
        out = capsys.readouterr().out
        assert out.startswith("brats-1: Slurm job 7 no longer listed by Slurm") and "epoch 3/5" in out
    assert main(["slurm", "status", "8", "--results", str(shared)]) == 2
    assert "Slurm job 8: Slurm no longer lists it" in capsys.readouterr().err
    assert main(["slurm", "status", "nobody", "--results", str(shared)]) == 2
    assert "no Slurm job named nobody" in capsys.readouterr().err


def test_a_job_not_made_by_submit_is_bad_input(shared, monkeypatch, capsys):
    job = _slurm_job(shared, "brats-1", "9") | {"StdOut": str(shared / "slurm-9.out")}
    monkeypatch.setattr(scheduler, "run_client", StandInJobs({"9": job}))
    assert main(["slurm", "logs", "9"]) == 2
    assert "Slurm job 9 (brats-1) was not submitted by bigmem-train submit" in capsys.readouterr().err


def test_logs_prints_the_jobs_output(shared, monkeypatch, capsys):
    monkeypatch.setattr(scheduler, "run_client", StandInJobs({"7": _slurm_job(shared, "brats-1", "7")}))
    assert main(["slurm", "logs", "7", "-n", "2"]) == 0
    assert capsys.readouterr().out == "line 8\nline 9\n"
    assert main(["slurm", "logs", "brats-1"]) == 0
    assert capsys.readouterr().out.count("\n") == 10


def test_stop_cancels_a_running_job_and_leaves_an_ended_one(shared, monkeypatch, capsys):
    jobs = StandInJobs({"7": _slurm_job(shared, "brats-1", "7")})
    monkeypatch.setattr(scheduler, "run_client", jobs)
    assert main(["slurm", "stop", "brats-1"]) == 0
    assert capsys.readouterr().out.startswith("brats-1: Slurm job 7 cancelled (CANCELLED); submit it again")
    assert ["scancel", "7"] in jobs.calls
    assert (shared / "brats-1" / "checkpoints" / "last.keras").exists()
    assert main(["slurm", "stop", "7"]) == 0
    assert capsys.readouterr().out.strip() == "brats-1: Slurm job 7 is not running (CANCELLED)"
    assert [call for call in jobs.calls if call[0] == "scancel"] == [["scancel", "7"]]


def test_fetch_copies_the_run_directory_and_the_log(shared, tmp_path, monkeypatch, capsys):
    (shared / "brats-1" / "verdict.json").write_text('{"verdict": "PASS"}')
    job = _slurm_job(shared, "brats-1", "7", state="COMPLETED")
    monkeypatch.setattr(scheduler, "run_client", StandInJobs({"7": job}))
    assert main(["slurm", "fetch", "7", "--to", str(tmp_path / "here"), "--no-checkpoints"]) == 0
    copy = tmp_path / "here" / "brats-1"
    assert capsys.readouterr().out.strip() == f"fetched {copy}; verdict PASS"
    assert sorted(path.name for path in copy.iterdir()) == [
        "config.yaml",
        "history.csv",
        "job.log",
        "memory.csv",
        "progress.json",
        "state.json",
        "verdict.json",
    ]
    assert (copy / "job.log").read_text().startswith("line 0\n")
    assert main(["slurm", "fetch", "7", "--to", str(tmp_path / "all")]) == 0
    assert (tmp_path / "all" / "brats-1" / "checkpoints" / "last.keras").exists()
    assert not (tmp_path / "all" / "brats-1" / "backup").exists()


def test_logs_follow_prints_until_slurm_says_the_job_ended(shared, monkeypatch):
    log = shared / "brats-1.slurm-7.out"

    class Ending(StandInJobs):
        """Each look at the job after the first: one more line of output, then the job has ended."""

        def __call__(self, command, **options):
            if command[:2] == ["scontrol", "show"] and any(call[:2] == command[:2] for call in self.calls):
                with log.open("a") as handle:
                    handle.write("epoch 5 done\n")
                self.jobs["7"]["JobState"] = "COMPLETED"
            return super().__call__(command, **options)

    monkeypatch.setattr(scheduler, "run_client", Ending({"7": _slurm_job(shared, "brats-1", "7")}))
    job = scheduler.find_job("7", shared)
    written = []
    assert scheduler.job_logs(job, follow=True, lines=1, write=written.append, poll_s=0) == 0
    assert "".join(written) == "line 9\nepoch 5 done\n"
