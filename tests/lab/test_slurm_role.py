"""The bigmem_slurm role for real on the lab VM (Debian 12, systemd, Slurm 22.05 from Debian's packages,
preinstalled by tests/lab/build_image.sh as the VM has no mirror): `--tags slurm` converges, a second run
changes nothing, `--check --diff` on the converged VM changes nothing; then the cluster itself answers:
the node has the CPUs and RealMemory its facts imply, the partition is up and idle, a job runs through
`srun`, and cgroup.conf enforces memory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.fixtures.common import REPO_ROOT
from tests.fixtures.lab import SYSTEM_NAME, TIMEOUT_SCALE, write_lab_inventory

pytestmark = [pytest.mark.lab, pytest.mark.slow]

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
RECAP = re.compile(
    rf"^{re.escape(SYSTEM_NAME)}\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M
)
OS_RESERVE_MIB = 512  # the VM has 2 GiB: the role's 4GiB default would leave nothing
PARTITION = "bigmem"
COMMAND = (
    "--limit",
    "bigmem",
    "--tags",
    "slurm",
    "-e",
    "bigmem_slurm_enabled=true",
    "-e",
    f"bigmem_slurm_os_reserve={OS_RESERVE_MIB}MiB",
    # The BMC plays no part in Slurm: preflight (tag always) need not read it.
    "-e",
    "bigmem_bios_enabled=false",
)


def run_playbook(
    inventory: Path, log: Path, *extra: str
) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    env = dict(
        os.environ, ANSIBLE_NOCOLOR="1", PATH=f"{ANSIBLE_PLAYBOOK.parent}:{os.environ.get('PATH', '')}"
    )
    env.pop("ANSIBLE_CONFIG", None)
    with open(log, "w") as handle:
        done = subprocess.run(
            [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), "site.yml", *COMMAND, *extra],
            cwd=REPO_ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=1800 * TIMEOUT_SCALE,
        )
    output = log.read_text(errors="replace")
    match = RECAP.search(output)
    assert match, f"no PLAY RECAP line for {SYSTEM_NAME}:\n{output[-4000:]}"
    ok, changed, unreachable, failed = map(int, match.groups())
    return done, {"ok": ok, "changed": changed, "unreachable": unreachable, "failed": failed}


@pytest.fixture(scope="module")
def slurm_runs(lab_vm, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lab-slurm")
    # The BMC is not started: the inventory's bmc_* values are placeholders, BIOS is off in every run.
    no_bmc = SimpleNamespace(url="https://127.0.0.1:9", system_id="none", ca_file=workdir / "none.pem")
    inventory = write_lab_inventory(workdir / "inventory.ini", lab_vm, no_bmc)
    runs = {}
    for name, extra in (("converge", ()), ("rerun", ()), ("check", ("--check", "--diff"))):
        started = time.monotonic()
        done, recap = run_playbook(inventory, workdir / f"{name}.log", *extra)
        runs[name] = (done, recap, time.monotonic() - started, workdir / f"{name}.log")
        if done.returncode != 0:
            break
    return runs


def _assert_ran(runs, name):
    assert name in runs, f"{name} did not run (an earlier run failed)"
    done, recap, _, log = runs[name]
    assert done.returncode == 0 and recap["failed"] == 0, log.read_text(errors="replace")[-6000:]
    return recap


def test_the_first_run_converges(slurm_runs):
    recap = _assert_ran(slurm_runs, "converge")
    assert recap["changed"] > 0


def test_a_second_run_changes_nothing(slurm_runs):
    recap = _assert_ran(slurm_runs, "rerun")
    assert recap["changed"] == 0, slurm_runs["rerun"][3].read_text(errors="replace")[-6000:]


def test_check_diff_on_the_converged_vm_changes_nothing(slurm_runs):
    recap = _assert_ran(slurm_runs, "check")
    assert recap["changed"] == 0, slurm_runs["check"][3].read_text(errors="replace")[-6000:]


def _fields(text: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def _wait_idle(lab_vm, timeout: float) -> str:
    deadline = time.monotonic() + timeout * TIMEOUT_SCALE
    state = ""
    while time.monotonic() < deadline:
        state = lab_vm.run(f"sinfo -h -p {PARTITION} -o %t", check=False).stdout.strip()
        if state == "idle":
            return state
        time.sleep(3)
    return state


def test_the_node_has_the_cpus_and_memory_its_facts_imply(slurm_runs, lab_vm):
    _assert_ran(slurm_runs, "converge")
    node = _fields(lab_vm.run(f"scontrol show node -o {SYSTEM_NAME}").stdout)
    memtotal_kib = int(lab_vm.run("awk '/^MemTotal:/ {print $2}' /proc/meminfo").stdout)
    # Ansible's memtotal_mb is MemTotal // 1024 (the VM: -smp 2,sockets=2,cores=1,threads=1).
    assert node["RealMemory"] == str(memtotal_kib // 1024 - OS_RESERVE_MIB), node
    assert node["CPUTot"] == "2" and node["Sockets"] == "2" and node["CoresPerSocket"] == "1", node
    assert node["ThreadsPerCore"] == "1", node
    assert "DRAIN" not in node["State"], node  # slurmd agreed with the declared layout and memory


def test_the_partition_is_up_and_idle(slurm_runs, lab_vm):
    _assert_ran(slurm_runs, "converge")
    assert _wait_idle(lab_vm, 120) == "idle", lab_vm.run("sinfo; scontrol show node", check=False).stdout
    partition = _fields(lab_vm.run(f"scontrol show partition -o {PARTITION}").stdout)
    assert partition["Default"] == "YES" and partition["State"] == "UP" and partition["Nodes"] == SYSTEM_NAME


def test_a_job_runs_through_srun_and_cgroup_conf_enforces_memory(slurm_runs, lab_vm):
    _assert_ran(slurm_runs, "converge")
    _wait_idle(lab_vm, 120)
    job = lab_vm.run("timeout 300 srun -N1 --mem=64M hostname", timeout=360, check=False)
    assert job.returncode == 0 and job.stdout.strip() == SYSTEM_NAME, job.stdout + job.stderr
    cgroup = lab_vm.run("cat /etc/slurm/cgroup.conf").stdout
    assert re.search(r"^ConstrainRAMSpace=yes$", cgroup, re.M), cgroup
    key = lab_vm.run("sudo stat -c '%U %a' /etc/munge/munge.key").stdout.split()
    assert key == ["munge", "400"]


def test_a_job_past_its_memory_request_is_killed_by_its_cgroup(slurm_runs, lab_vm):
    """ConstrainRAMSpace at work: 200 MiB touched under --mem=48M ends in the cgroup's OOM killer."""
    _assert_ran(slurm_runs, "converge")
    _wait_idle(lab_vm, 120)
    hog = "python3 -c 'b = bytearray(200 * 2**20); print(len(b))'"
    job = lab_vm.run(f"timeout 300 srun -N1 --mem=48M {hog}", timeout=360, check=False)
    assert job.returncode != 0, job.stdout + job.stderr
    assert "oom" in (job.stdout + job.stderr).lower(), job.stdout + job.stderr
    fits = lab_vm.run(f"timeout 300 srun -N1 --mem=400M {hog}", timeout=360, check=False)
    assert fits.returncode == 0 and fits.stdout.strip() == str(200 * 2**20), fits.stdout + fits.stderr
