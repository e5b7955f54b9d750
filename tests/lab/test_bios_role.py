"""The bios role against the Redfish emulator's iDRAC rules, without the VM (seconds, not minutes).

The play runs `ansible-playbook site.yml --tags bios` from the repository root for a host that is the
test machine itself (ansible_connection=local, never rebooted: bigmem_allow_reboot stays false) whose BMC
is a fresh emulator (tests/lab/bmc.py) with two systems. The emulator keeps staged values pending until
a Redfish reset, refuses a second PATCH while values are pending (HTTP 400, iDRAC's SYS011), refuses
read-only attributes (ProcCStates & co. unless SysProfile is Custom) and unknown names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.common import REPO_ROOT
from tests.fixtures.lab import OTHER_SYSTEM_NAME, LabBMC, system_id

pytestmark = [pytest.mark.lab]

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=\d+\s+"
    r"failed=(?P<failed>\d+)",
    re.MULTILINE,
)
HOST = "bmc-only"


def _profile() -> dict:
    defaults = yaml.safe_load(
        (REPO_ROOT / "ansible" / "roles" / "bigmem_bios" / "defaults" / "main.yml").read_text()
    )
    return defaults["bigmem_bios_profiles"]["dell"]


def _initial() -> dict:
    return json.loads((REPO_ROOT / "tests" / "lab" / "bios-initial.json").read_text())


def _changes() -> dict:
    initial = _initial()
    return {key: value for key, value in _profile().items() if initial[key] != value}


def play(
    bmc: LabBMC,
    tmp_path: Path,
    *extra: str,
    resource_id: bool = True,
    playbook: str = "site.yml",
    connection: str = "ansible_connection=local",
) -> tuple[int, str, dict]:
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[bigmem]\n"
        f"{HOST} {connection} ansible_python_interpreter={sys.executable} ansible_become=false "
        f"bmc_address={bmc.url.removeprefix('https://')} bmc_vendor=dell bigmem_bmc_ca_path={bmc.ca_file} "
        + (f"bmc_resource_id={bmc.system_id}" if resource_id else "")
        + "\n"
        "[bigmem:vars]\n"
        "bigmem_bios_enabled=true\n"
        "bigmem_os_tuning_enabled=false\nbigmem_docker_engine_enabled=false\n"
        "bigmem_image_enabled=false\nbigmem_train_enabled=false\n"
        "bigmem_preflight_check_memory=false\nbigmem_preflight_check_os=false\n"
    )
    env = {
        **os.environ,
        "BIGMEM_BMC_USERNAME": bmc.username,
        "BIGMEM_BMC_PASSWORD": bmc.password,
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
    }
    env.pop("ANSIBLE_CONFIG", None)
    tags = ["--tags", "bios"] if playbook == "site.yml" else []
    result = subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "-i",
            str(inventory),
            playbook,
            *tags,
            "-e",
            "bigmem_allow_reboot=false",
            *extra,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    recap = {m["host"]: {k: int(m[k]) for k in ("ok", "changed", "failed")} for m in RECAP.finditer(output)}
    return result.returncode, output, recap.get(HOST, {})


def bios(bmc: LabBMC, name: str | None = None) -> tuple[dict, dict]:
    """(current, pending) BIOS attributes of a system."""
    path = bmc.system_path(name)
    return bmc.get(path + "/BIOS")["Attributes"], bmc.get(path + "/BIOS/Settings")["Attributes"]


def restart(bmc: LabBMC) -> None:
    bmc.request("POST", bmc.system_path() + "/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"})


def test_rerun_before_the_reboot_succeeds_and_stages_nothing(bmc_alone, tmp_path):
    """iDRAC refuses a second PATCH while values are pending: the rerun the role's own message asks for
    must read them, find them equal to the profile and not stage again."""
    rc, output, recap = play(bmc_alone, tmp_path)
    assert rc == 0, output[-5000:]
    current, pending = bios(bmc_alone)
    assert pending == _changes(), pending  # staged together: SysProfile=Custom and the Custom-only attributes
    assert next(iter(pending)) == "SysProfile", pending  # the attribute the others depend on comes first
    assert current == _initial(), current  # nothing applies before the reset
    assert recap["changed"] >= 1, output[-3000:]
    assert "reboot required" in output.lower(), output[-3000:]

    rc, output, recap = play(bmc_alone, tmp_path)  # the rerun, values still pending
    assert rc == 0, output[-5000:]
    assert "refused" not in output, output[-5000:]
    assert recap["changed"] == 0, output[-5000:]
    assert "already pending" in output, output[-5000:]
    assert bios(bmc_alone)[1] == _changes()

    restart(bmc_alone)  # the BIOS applies the pending values at POST
    current, pending = bios(bmc_alone)
    assert pending == {} and all(current[key] == value for key, value in _profile().items()), current
    rc, output, recap = play(bmc_alone, tmp_path)
    assert rc == 0 and recap["changed"] == 0, output[-5000:]
    assert "reboot required" not in output.lower(), output[-3000:]


def test_other_pending_values_stop_the_play_unless_replacing_is_allowed(bmc_alone, tmp_path):
    bmc_alone.request(
        "PATCH", bmc_alone.system_path() + "/BIOS/Settings", {"Attributes": {"BootMode": "Uefi"}}
    )
    rc, output, _ = play(bmc_alone, tmp_path)
    assert rc != 0
    assert re.search(r"BootMode.*pending", output), output[-5000:]
    assert "bigmem_bios_replace_pending" in output, output[-5000:]
    assert bios(bmc_alone)[1] == {"BootMode": "Uefi"}  # left as found

    rc, output, _ = play(bmc_alone, tmp_path, "-e", "bigmem_bios_replace_pending=true")
    assert rc == 0, output[-5000:]
    assert bios(bmc_alone)[1] == _changes()


def test_check_mode_shows_each_attribute_and_changes_nothing(bmc_alone, tmp_path):
    rc, output, recap = play(bmc_alone, tmp_path, "--check", "--diff")
    assert rc == 0, output[-5000:]
    assert recap["changed"] >= 1, output[-5000:]
    for key, value in _changes().items():
        assert re.search(rf'^-\s+"{key}": "{_initial()[key]}"', output, re.MULTILINE), (key, output[-5000:])
        assert re.search(rf'^\+\s+"{key}": "{value}"', output, re.MULTILINE), (key, output[-5000:])
    assert bios(bmc_alone) == (_initial(), {})


def test_the_system_is_found_by_bmc_resource_id(bmc_alone, tmp_path):
    rc, output, _ = play(bmc_alone, tmp_path, resource_id=False)
    assert rc != 0
    assert "bmc_resource_id" in output and system_id(OTHER_SYSTEM_NAME) in output, output[-5000:]
    assert bios(bmc_alone)[1] == {} and bios(bmc_alone, OTHER_SYSTEM_NAME)[1] == {}

    rc, output, _ = play(bmc_alone, tmp_path)  # bmc_resource_id: the lab system, listed second by the BMC
    assert rc == 0, output[-5000:]
    assert bios(bmc_alone)[1] == _changes()
    assert bios(bmc_alone, OTHER_SYSTEM_NAME) == (_initial(), {})


def test_preflight_refuses_mirrored_memory_when_the_job_needs_it(bmc_alone, tmp_path):
    """The BMC reports MemOpMode=MirrorMode (the OS sees half the installed memory): a job that does not fit
    what the OS sees is refused with the mode named; one that fits gets a warning. The profile sets
    OptimizerMode."""
    assert _profile()["MemOpMode"] == "OptimizerMode"
    bmc_alone.request(
        "PATCH", bmc_alone.system_path() + "/BIOS/Settings", {"Attributes": {"MemOpMode": "MirrorMode"}}
    )
    restart(bmc_alone)
    assert bios(bmc_alone)[0]["MemOpMode"] == "MirrorMode"
    rc, output, _ = play(
        bmc_alone,
        tmp_path,
        "-e",
        "bigmem_preflight_check_memory=true",
        "-e",
        "bigmem_train_target_footprint=95%",
    )
    assert rc != 0
    assert "reports MemOpMode=MirrorMode" in output and "OptimizerMode" in output, output[-5000:]
    assert bios(bmc_alone)[1] == {}, "preflight changed the BIOS"
    rc, output, _ = play(
        bmc_alone,
        tmp_path,
        "-e",
        "bigmem_preflight_check_memory=true",
        "-e",
        "bigmem_train_target_footprint=10%",
    )
    assert rc == 0, output[-5000:]
    assert "WARNING: the BMC of bmc-only reports MemOpMode=MirrorMode" in output, output[-5000:]
    assert bios(bmc_alone)[1]["MemOpMode"] == "OptimizerMode"  # the bios role stages the full-memory mode


def test_a_host_that_does_not_answer_is_reset_through_the_bmc(bmc_alone, tmp_path):
    """Reboot through the OS when SSH answers; through the BMC only when it does not. This host's SSH port is
    closed: the play asks the BMC for the restart (PowerGracefulRestart, which this BMC, like many iDRAC 9,
    does not offer: community.general sends ForceRestart), the pending BIOS values apply at that reset, and
    the play then fails because the host never answers."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    log_start = len(bmc_alone.log.read_text())
    rc, output, _ = play(
        bmc_alone,
        tmp_path,
        "-e",
        "bigmem_allow_reboot=true",
        "-e",
        "bigmem_reboot_ssh_timeout=5",
        "-e",
        "bigmem_reboot_timeout=20",
        playbook="tests/lab/bios_reboot.yml",
        connection=f"ansible_host=127.0.0.1 ansible_port={port} ansible_user=nobody",
    )
    log = bmc_alone.log.read_text()[log_start:]
    assert rc != 0, output[-5000:]
    assert "Power the host on, or reset it, through the BMC" in output, output[-5000:]
    assert "Reboot through the OS" not in output, output[-5000:]  # skipped tasks are not shown
    assert 'power state set to "ForceRestart"' in log and "GracefulRestart" not in log, log[-3000:]
    current, pending = bios(bmc_alone)
    assert pending == {} and all(current[key] == value for key, value in _profile().items()), (
        current,
        pending,
    )
