"""``bigmem-train submit`` without Slurm: the batch script's --mem is the plan's envelope peak rounded up to
MiB, --time is checked, a plan larger than the partition's nodes is refused (exit 3), and --dry-run
submits nothing. ``sinfo`` and ``sbatch`` are stand-ins (``scheduler.run_client`` replaced)."""

from __future__ import annotations

import math
import subprocess

import pytest

from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import read_host_facts
from bigmem_train.memory.plan import plan_job
from bigmem_train.ops import scheduler
from tests.fixtures.common import write_tiny_job


def _plan(job):
    return plan_job(load_config(str(job), {}, {}), read_host_facts(), to_run_here=False)


class StandInSlurm:
    """A stand-in for sinfo and sbatch: one partition with nodes of ``memory_mib``; records every call."""

    def __init__(self, memory_mib: int, partition: str = "bigmem", cpus: int = 64, job_id: str = "4242"):
        self.memory_mib, self.partition, self.cpus, self.job_id = memory_mib, partition, cpus, job_id
        self.calls: list[list[str]] = []
        self.scripts: list[str] = []

    def __call__(self, command, **options):
        self.calls.append(command)
        if command[0] == "sinfo":
            lines = (
                f"{self.partition}\n"
                if command[-1] == "%P"
                else f"{self.partition}* {self.memory_mib} {self.cpus} 2\n"
            )
            if "-p" in command and command[command.index("-p") + 1] != self.partition:
                lines = ""
            return subprocess.CompletedProcess(command, 0, lines, "")
        if command[0] == "sbatch":
            self.scripts.append(options["input"])
            return subprocess.CompletedProcess(command, 0, f"{self.job_id}\n", "")
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
    expected = math.ceil(_plan(tiny).peak_bytes * 1.03 / 2**20)  # independent of the renderer
    assert f"#SBATCH --mem={expected}M\n" in out
    assert "#SBATCH --partition=bigmem\n" in out
    assert "#SBATCH --time=0-01:00\n" in out
    assert "#SBATCH --job-name=s1\n" in out
    assert f"#SBATCH --output={tmp_path / 'results' / 's1.slurm-%j.out'}\n" in out
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
    request = math.ceil(_plan(tiny).peak_bytes * 1.03 / 2**20)
    stand_in = StandInSlurm(memory_mib=request - 1)
    monkeypatch.setattr(scheduler, "run_client", stand_in)
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--run-name", "s3"]) == 3
    err = capsys.readouterr().err
    assert f"--mem={request}M) does not fit partition bigmem" in err
    assert f"RealMemory {request - 1}M" in err
    assert all(call[0] != "sbatch" for call in stand_in.calls)


def test_a_plan_of_exactly_the_nodes_memory_fits(tiny, tmp_path, monkeypatch):
    request = math.ceil(_plan(tiny).peak_bytes * 1.03 / 2**20)
    monkeypatch.setattr(scheduler, "run_client", StandInSlurm(memory_mib=request))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--config", str(tiny), "--run-name", "s4", "--dry-run"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--partition", "gpu"], "--partition gpu: no such partition (sinfo shows: bigmem)"),
        (["--time", "2h"], "--time '2h': not a Slurm time"),
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
