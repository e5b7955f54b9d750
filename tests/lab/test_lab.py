"""The virtual bare-metal lab itself: the VM boots with two NUMA nodes and the BMC answers Redfish."""

import ssl
import time
import urllib.error
import urllib.request

import pytest

from tests.fixtures.lab import OTHER_SYSTEM_NAME, TIMEOUT_SCALE

pytestmark = [pytest.mark.lab, pytest.mark.slow]


def test_vm_boots_with_ssh_and_two_numa_nodes(lab_vm):
    nodes = lab_vm.run("ls -d /sys/devices/system/node/node*").stdout.split()
    assert nodes == ["/sys/devices/system/node/node0", "/sys/devices/system/node/node1"]
    for node in (0, 1):
        meminfo = lab_vm.run(f"cat /sys/devices/system/node/node{node}/meminfo").stdout
        total_kib = int(meminfo.split("MemTotal:")[1].split()[0])
        assert total_kib > 700 * 1024, meminfo
    assert lab_vm.run("sudo -n id -u").stdout.strip() == "0"
    assert lab_vm.run("systemctl is-system-running --wait || true", timeout=300).stdout.strip() in (
        "running",
        "degraded",
    )
    assert "console=ttyS0" in lab_vm.run("cat /proc/cmdline").stdout
    assert lab_vm.run("test -d /boot/grub/i386-pc && test -x /usr/sbin/update-grub").returncode == 0


def test_bmc_serves_redfish_over_tls_with_basic_auth(lab_bmc):
    systems = lab_bmc.get("/redfish/v1/Systems")
    assert systems["Members@odata.count"] == 2  # the lab system and another one: bmc_resource_id is needed
    names = {lab_bmc.get(member["@odata.id"])["Name"] for member in systems["Members"]}
    assert names == {lab_bmc.system_name, OTHER_SYSTEM_NAME}
    system = lab_bmc.get(lab_bmc.system_path())
    assert system["Name"] == lab_bmc.system_name and system["Id"] == lab_bmc.system_id
    assert system["PowerState"] == "On"
    bios = lab_bmc.get(system["Bios"]["@odata.id"])
    assert bios["Attributes"], "the BMC must expose BIOS attributes"
    assert lab_bmc.get("/redfish/v1/")["Vendor"] == "Dell"


def test_bmc_rejects_bad_credentials_and_unverified_tls(lab_bmc):
    context = ssl.create_default_context(cafile=str(lab_bmc.ca_file))
    request = urllib.request.Request(
        lab_bmc.url + "/redfish/v1/Systems", headers={"Authorization": "Basic YmFkOmJhZA=="}
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, context=context, timeout=30)
    assert raised.value.code == 401
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(lab_bmc.url + "/redfish/v1/", context=ssl.create_default_context(), timeout=30)


def test_redfish_restart_reboots_the_vm_and_applies_pending_bios_values(lab_vm, lab_bmc):
    """The BMC is wired to the VM: a Redfish ForceRestart really reboots it (new boot id), and the BIOS
    values pending until then apply at that reset. Like many iDRAC 9 firmwares, the BMC does not offer
    GracefulRestart and refuses it."""
    before = lab_vm.boot_id()
    system = lab_bmc.system_path()
    offered = lab_bmc.get(system)["Actions"]["#ComputerSystem.Reset"]["ResetType@Redfish.AllowableValues"]
    assert "GracefulRestart" not in offered and "ForceRestart" in offered, offered
    status, message = lab_bmc.error_of(
        "POST", f"{system}/Actions/ComputerSystem.Reset", {"ResetType": "GracefulRestart"}
    )
    assert status == 400 and "GracefulRestart" in message, (status, message)
    assert lab_bmc.get(system + "/BIOS")["Attributes"]["BootMode"] == "Bios"
    lab_bmc.request("PATCH", f"{system}/BIOS/Settings", {"Attributes": {"BootMode": "Uefi"}})
    assert lab_bmc.get(system + "/BIOS/Settings")["Attributes"] == {"BootMode": "Uefi"}
    assert lab_bmc.get(system + "/BIOS")["Attributes"]["BootMode"] == "Bios"  # pending until the reset
    lab_bmc.request("POST", f"{system}/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"})
    deadline = time.monotonic() + 400 * TIMEOUT_SCALE
    after = before
    while time.monotonic() < deadline and after == before:
        time.sleep(5)
        result = lab_vm.run("cat /proc/sys/kernel/random/boot_id", timeout=30, check=False)
        if result.returncode == 0:
            after = result.stdout.strip()
    assert after != before, "the VM did not reboot after a Redfish ForceRestart"
    assert lab_bmc.get(system)["PowerState"] == "On"
    assert lab_bmc.get(system + "/BIOS/Settings")["Attributes"] == {}
    assert lab_bmc.get(system + "/BIOS")["Attributes"]["BootMode"] == "Uefi"
