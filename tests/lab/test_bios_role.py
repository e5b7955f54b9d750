"""The bios role against the Redfish emulator's iDRAC and iLO rules, without the VM (seconds, not minutes).

The play runs `ansible-playbook site.yml --tags bios` from the repository root for a host that is the
test machine itself (ansible_connection=local, never rebooted: bigmem_allow_reboot stays false) whose BMC
is a fresh emulator (tests/lab/bmc.py) with two systems, of one of four flavours: Dell iDRAC or HPE iLO, for an
Intel or an AMD server. The emulator keeps staged values pending until a Redfish reset; iDRAC refuses a second
PATCH while values are pending (HTTP 400, SYS011: older firmware) or appends it (newer), iLO merges it; both
refuse unknown names and values outside the registry, and the attributes a system or workload profile governs
(iDRAC refuses them, iLO loses them at POST) unless SysProfile/WorkloadProfile is Custom.
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
from tests.fixtures.lab import OTHER_SYSTEM_NAME, LabBMC, initial_bios_attributes_file, system_id

pytestmark = [pytest.mark.lab]

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=\d+\s+"
    r"failed=(?P<failed>\d+)",
    re.MULTILINE,
)
HOST = "bmc-only"
# Emulator flavour -> (bmc_vendor, the profile the role must pick from what the system reports).
FLAVOURS = {
    "dell-intel": ("dell", "dell_intel"),
    "dell-amd": ("dell", "dell_amd"),
    "hpe-intel": ("hpe", "hpe_intel"),
    "hpe-amd": ("hpe", "hpe_amd"),
}
GOVERNOR = {"dell": "SysProfile", "hpe": "WorkloadProfile"}
each_flavour = pytest.mark.parametrize("bmc_alone", list(FLAVOURS), indirect=True, ids=list(FLAVOURS))


def _profile(flavour: str = "dell-intel") -> dict:
    defaults = yaml.safe_load(
        (REPO_ROOT / "ansible" / "roles" / "bigmem_bios" / "defaults" / "main.yml").read_text()
    )
    return defaults["bigmem_bios_profiles"][FLAVOURS[flavour][1]]


def _initial(flavour: str = "dell-intel") -> dict:
    return json.loads(initial_bios_attributes_file(flavour).read_text())


def _changes(flavour: str = "dell-intel") -> dict:
    initial = _initial(flavour)
    return {key: str(value) for key, value in _profile(flavour).items() if initial[key] != str(value)}


def _applied(current: dict, flavour: str) -> bool:
    return all(current[key] == str(value) for key, value in _profile(flavour).items())


def play(
    bmc: LabBMC,
    tmp_path: Path,
    *extra: str,
    resource_id: bool = True,
    playbook: str = "site.yml",
    connection: str = "ansible_connection=local",
    vendor: str = "dell",
) -> tuple[int, str, dict]:
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[bigmem]\n"
        f"{HOST} {connection} ansible_python_interpreter={sys.executable} ansible_become=false "
        f"bmc_address={bmc.url.removeprefix('https://')} bmc_vendor={vendor} bigmem_bmc_ca_path={bmc.ca_file} "
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


def flat(output: str) -> str:
    """The play's output with its line wrapping undone (the yaml callback folds long messages)."""
    return " ".join(output.split())


def bios(bmc: LabBMC, name: str | None = None) -> tuple[dict, dict]:
    """(current, pending) BIOS attributes of a system (iLO's whole future state reduced to what differs)."""
    path = bmc.system_path(name)
    current = bmc.get(path + "/BIOS")["Attributes"]
    settings = bmc.get(path + "/BIOS/Settings")["Attributes"]
    return current, {key: value for key, value in settings.items() if current.get(key) != value}


def restart(bmc: LabBMC) -> None:
    bmc.request("POST", bmc.system_path() + "/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"})


@each_flavour
def test_converge_rerun_and_verify_on_each_flavour(bmc_alone, tmp_path, request):
    """The role picks the flavour's profile from what the system reports (bmc_vendor names only the vendor), stages
    it in one request with the attribute the others depend on first; the rerun before the reboot stages nothing
    (iDRAC would refuse a second PATCH); after the reset every value is applied and verified, and a rerun changes
    nothing."""
    flavour = request.node.callspec.params["bmc_alone"]
    vendor, profile = FLAVOURS[flavour]
    rc, output, recap = play(bmc_alone, tmp_path, vendor=vendor)
    assert rc == 0, output[-5000:]
    assert f"BIOS profile {profile} (bmc_vendor={vendor} and ProcessorSummary.Model=" in flat(output), output[
        -5000:
    ]
    current, pending = bios(bmc_alone)
    assert pending == _changes(flavour), pending
    # One PATCH, the attribute the others depend on first in it (iLO's settings page does not keep the order).
    assert bmc_alone.log.read_text().count("pending until the next reset") == 1, bmc_alone.log.read_text()[
        -3000:
    ]
    assert f"BIOS values {{'{GOVERNOR[vendor]}': 'Custom'" in bmc_alone.log.read_text(), (
        bmc_alone.log.read_text()
    )
    assert current == _initial(flavour), current  # nothing applies before the reset
    assert recap["changed"] >= 1, output[-3000:]
    assert "reboot required" in output.lower(), output[-3000:]

    rc, output, recap = play(bmc_alone, tmp_path, vendor=vendor)  # the rerun, values still pending
    assert rc == 0, output[-5000:]
    assert "refused" not in output, output[-5000:]
    assert recap["changed"] == 0, output[-5000:]
    assert "already pending" in output, output[-5000:]
    assert bios(bmc_alone)[1] == _changes(flavour)

    restart(bmc_alone)  # the BIOS applies the pending values at POST
    current, pending = bios(bmc_alone)
    assert pending == {} and _applied(current, flavour), current
    rc, output, recap = play(bmc_alone, tmp_path, vendor=vendor, playbook="tests/lab/bios_verify.yml")
    assert rc == 0 and recap["changed"] == 0, output[-5000:]
    assert f"BIOS attributes {', '.join(_profile(flavour))} verified" in flat(output), output[-5000:]
    assert "reboot required" not in output.lower(), output[-3000:]


@pytest.mark.parametrize(
    "bmc_alone",
    [{"flavour": "dell-amd", "processor_model": ""}, {"flavour": "hpe-amd", "processor_model": ""}],
    indirect=True,
    ids=["dell-amd", "hpe-amd"],
)
def test_without_a_cpu_model_the_profile_is_picked_from_the_attribute_names(bmc_alone, tmp_path, request):
    flavour = request.node.callspec.params["bmc_alone"]["flavour"]
    vendor, profile = FLAVOURS[flavour]
    rc, output, _ = play(bmc_alone, tmp_path, vendor=vendor)
    assert rc == 0, output[-5000:]
    assert f"BIOS profile {profile} (bmc_vendor={vendor}, and {profile} is the one {vendor} profile" in flat(
        output
    ), output[-5000:]
    assert bios(bmc_alone)[1] == _changes(flavour)


@pytest.mark.parametrize(
    "bmc_alone, named, missing, instead",
    [
        (
            "dell-amd",
            "dell_intel",
            "SubNumaCluster",
            "bigmem_bios_profile=dell_amd, which sets NumaNodesPerSocket=1",
        ),
        ("hpe-amd", "hpe_intel", "ProcTurbo", "bigmem_bios_profile=hpe_amd, which sets ProcAMDBoost=Enabled"),
        (
            "hpe-intel",
            "hpe_amd",
            "ProcAMDBoost",
            "bigmem_bios_profile=hpe_intel, which sets ProcTurbo=Enabled",
        ),
    ],
    indirect=["bmc_alone"],
)
def test_a_named_profile_the_bios_lacks_names_its_attributes_and_what_to_set_instead(
    bmc_alone, tmp_path, named, missing, instead
):
    vendor = named.split("_")[0]
    rc, output, _ = play(bmc_alone, tmp_path, "-e", f"bigmem_bios_profile={named}", vendor=vendor)
    assert rc != 0
    assert f"{missing} (from profile {named})" in flat(output), output[-5000:]
    assert instead in flat(output), output[-5000:]
    assert bios(bmc_alone)[1] == {}  # nothing staged


@pytest.mark.parametrize("bmc_alone", ["hpe-amd"], indirect=True)
def test_a_bmc_vendor_the_system_contradicts_is_refused(bmc_alone, tmp_path):
    rc, output, _ = play(bmc_alone, tmp_path, vendor="dell")
    assert rc != 0
    assert "bmc_vendor=dell, but the system reports Manufacturer=HPE: set bmc_vendor=hpe" in flat(output), (
        output[-5000:]
    )
    assert bios(bmc_alone)[1] == {}


@pytest.mark.parametrize(
    "bmc_alone, left_out",
    [
        ({"flavour": "dell-intel", "idrac_second_patch": "refuse"}, "MemFrequency"),
        ({"flavour": "dell-intel", "idrac_second_patch": "append"}, "MemFrequency"),
        ("hpe-amd", "NumaMemoryDomainsPerSocket"),
    ],
    indirect=["bmc_alone"],
    ids=["idrac-refuses", "idrac-appends", "ilo-merges"],
)
def test_a_profile_grown_while_part_of_it_is_pending_is_staged_whole(bmc_alone, tmp_path, request, left_out):
    """An earlier run staged the profile without one attribute; the reboot has not happened. Older iDRAC firmware
    refuses a second PATCH while the BIOS job is scheduled (SYS011), newer appends to it, iLO merges: the role
    does what Dell's idrac_bios module does where it can clear (merge pending and new values, clear the values
    and their job, PATCH them all), and PATCHes only the rest where the BMC merges. One case per BMC rule (the
    profile's own values are covered on every flavour by the converge test): each case is two plays of a
    minute on CI's host."""
    options = request.node.callspec.params["bmc_alone"]
    flavour = options if isinstance(options, str) else options["flavour"]
    vendor = FLAVOURS[flavour][0]
    assert left_out in _changes(flavour)
    rc, output, _ = play(
        bmc_alone, tmp_path, "-e", json.dumps({"bigmem_bios_attributes": {left_out: None}}), vendor=vendor
    )
    assert rc == 0, output[-5000:]
    assert left_out not in bios(bmc_alone)[1]
    rc, output, recap = play(bmc_alone, tmp_path, vendor=vendor)
    assert rc == 0, output[-5000:]
    assert "are pending on the BMC (an earlier run), and the profile also needs" in flat(output), output[
        -5000:
    ]
    assert recap["changed"] >= 1, output[-5000:]
    assert bios(bmc_alone)[1] == _changes(flavour)
    restart(bmc_alone)
    assert _applied(bios(bmc_alone)[0], flavour)


@pytest.mark.parametrize("bmc_alone", ["hpe-intel"], indirect=True)
def test_ilo_grayed_out_attributes_are_refused_without_the_custom_workload_profile(bmc_alone, tmp_path):
    """iLO accepts a PATCH of PowerRegulator & co. while WorkloadProfile is not Custom, then the workload profile
    puts its own values back at POST: the role refuses to stage them (the registry's GrayOut dependency)."""
    bmc_alone.request(
        "PATCH",
        bmc_alone.system_path() + "/BIOS/Settings",
        {"Attributes": {"PowerRegulator": "StaticHighPerf"}},
    )
    restart(bmc_alone)
    assert bios(bmc_alone)[0]["PowerRegulator"] == _initial("hpe-intel")["PowerRegulator"]  # lost at POST
    extra = json.dumps({"bigmem_bios_attributes": {"WorkloadProfile": None}})
    rc, output, _ = play(bmc_alone, tmp_path, "-e", extra, vendor="hpe")
    assert rc != 0
    assert "PowerRegulator is read-only while WorkloadProfile NEQ Custom" in flat(output), output[-5000:]
    assert bios(bmc_alone)[1] == {}


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


@pytest.mark.parametrize("bmc_alone", ["dell-intel", "hpe-amd"], indirect=True)
def test_check_mode_shows_each_attribute_and_changes_nothing(bmc_alone, tmp_path, request):
    """One iDRAC, one iLO: the diff is the role's, the values the flavour's (each flavour's goal values are
    checked staged by the converge test)."""
    flavour = request.node.callspec.params["bmc_alone"]
    rc, output, recap = play(bmc_alone, tmp_path, "--check", "--diff", vendor=FLAVOURS[flavour][0])
    assert rc == 0, output[-5000:]
    assert recap["changed"] >= 1, output[-5000:]
    for key, value in _changes(flavour).items():
        before = _initial(flavour)[key]
        assert re.search(rf'^-\s+"{key}": "{before}"', output, re.MULTILINE), (key, output[-5000:])
        assert re.search(rf'^\+\s+"{key}": "{value}"', output, re.MULTILINE), (key, output[-5000:])
    assert bios(bmc_alone) == (_initial(flavour), {})


@pytest.mark.parametrize(
    "bmc_alone, attribute, value, allowed",
    [
        ("dell-amd", "NumaNodesPerSocket", "3", "0, 1, 2, 4"),
        ("hpe-amd", "PowerRegulator", "DynamicPowerSavings", "StaticHighPerf, OsControl"),
    ],
    indirect=["bmc_alone"],
)
def test_a_value_the_registry_does_not_list_is_refused_before_anything_is_staged(
    bmc_alone, tmp_path, request, attribute, value, allowed
):
    flavour = request.node.callspec.params["bmc_alone"]
    extra = json.dumps({"bigmem_bios_attributes": {attribute: value}})
    rc, output, _ = play(bmc_alone, tmp_path, "-e", extra, vendor=FLAVOURS[flavour][0])
    assert rc != 0
    assert f"{attribute}={value} is not one of {allowed}" in flat(output), output[-5000:]
    assert bios(bmc_alone)[1] == {}


def test_the_system_is_found_by_bmc_resource_id(bmc_alone, tmp_path):
    rc, output, _ = play(bmc_alone, tmp_path, resource_id=False)
    assert rc != 0
    assert "bmc_resource_id" in output and system_id(OTHER_SYSTEM_NAME) in output, output[-5000:]
    assert bios(bmc_alone)[1] == {} and bios(bmc_alone, OTHER_SYSTEM_NAME)[1] == {}

    rc, output, _ = play(bmc_alone, tmp_path)  # bmc_resource_id: the lab system, listed second by the BMC
    assert rc == 0, output[-5000:]
    assert bios(bmc_alone)[1] == _changes()
    assert bios(bmc_alone, OTHER_SYSTEM_NAME) == (_initial(), {})


@pytest.mark.parametrize(
    "bmc_alone, attribute, mirrored",
    [
        ("dell-intel", "MemOpMode", "MirrorMode"),
        ("hpe-intel", "AdvancedMemProtection", "MirroredAdvancedEcc"),
    ],
    indirect=["bmc_alone"],
)
def test_preflight_refuses_mirrored_memory_when_the_job_needs_it(
    bmc_alone, tmp_path, request, attribute, mirrored
):
    """The BMC reports mirrored memory (the OS sees half the installed memory): a job that does not fit what the OS
    sees is refused with the mode named; one that fits gets a warning. The profile sets the full-memory mode."""
    flavour = request.node.callspec.params["bmc_alone"]
    vendor = FLAVOURS[flavour][0]
    full = _profile(flavour)[attribute]
    assert full in ("OptimizerMode", "AdvancedEcc")
    bmc_alone.request(
        "PATCH", bmc_alone.system_path() + "/BIOS/Settings", {"Attributes": {attribute: mirrored}}
    )
    restart(bmc_alone)
    assert bios(bmc_alone)[0][attribute] == mirrored
    memory = ("-e", "bigmem_preflight_check_memory=true", "-e", "bigmem_train_target_footprint=95%")
    rc, output, _ = play(bmc_alone, tmp_path, *memory, vendor=vendor)
    assert rc != 0
    assert f"reports {attribute}={mirrored}" in flat(output) and full in output, output[-5000:]
    assert bios(bmc_alone)[1] == {}, "preflight changed the BIOS"
    memory = ("-e", "bigmem_preflight_check_memory=true", "-e", "bigmem_train_target_footprint=10%")
    rc, output, _ = play(bmc_alone, tmp_path, *memory, vendor=vendor)
    assert rc == 0, output[-5000:]
    assert f"WARNING: the BMC of bmc-only reports {attribute}={mirrored}" in flat(output), output[-5000:]
    assert bios(bmc_alone)[1][attribute] == full  # the bios role stages the full-memory mode


@pytest.mark.parametrize("bmc_alone", ["dell-amd", "hpe-amd"], indirect=True)
def test_preflight_says_it_cannot_tell_the_memory_mode_of_an_amd_bios(bmc_alone, tmp_path, request):
    """The AMD BIOSes offer no mirroring or sparing attribute and the BMC reports no MemoryMirroring: preflight says
    it cannot tell, rather than passing the check silently."""
    flavour = request.node.callspec.params["bmc_alone"]
    memory = ("-e", "bigmem_preflight_check_memory=true", "-e", "bigmem_train_target_footprint=10%")
    rc, output, _ = play(bmc_alone, tmp_path, *memory, vendor=FLAVOURS[flavour][0])
    assert rc == 0, output[-5000:]
    text = flat(output)
    assert "NOTE: cannot tell whether the memory of bmc-only is mirrored or spared" in text, output[-5000:]
    assert f"BIOS profile {FLAVOURS[flavour][1]};" in text, output[-5000:]
    assert "WARNING: the BMC" not in text, output[-5000:]


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
