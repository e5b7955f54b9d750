"""Redfish BMC emulator for the virtual lab server: sushy-tools wired to the QEMU VM.

Run with the Python that has sushy-tools and libvirt-python (the lab fixture makes a venv for it):

    python tests/lab/bmc.py --port 8443 --cert cert.pem --key key.pem --auth-file htpasswd \
        --bios-attributes bios.json --qmp-socket qmp.sock --system-name bigmem-lab-01

sushy-tools serves the Redfish API; its libvirt driver is the one that offers the BIOS resource.
It talks to libvirt's in-process test driver (``test:///default``: no libvirtd), in which this script
defines one domain that describes the lab server (2 vCPUs, 2 NUMA nodes) and carries the BIOS
attributes. One connection to the test driver stays open for the life of the process, because the
test driver forgets its state when its last connection closes.

The test driver's power actions change only its own bookkeeping, so this script forwards them to the
QEMU VM over QMP, as a real BMC drives the server's reset and power lines: ForceRestart -> reset,
GracefulRestart -> ACPI power button, then power back on once the guest has shut down, ForceOff ->
pause, On -> resume. A Redfish reboot therefore really reboots the lab server.

On top of sushy-tools (whose BIOS applies a PATCH at once, accepts any name and never says no), the
BIOS behaves like a Dell iDRAC 9's or an HPE iLO 5/6's, for an Intel or an AMD server (``--flavour``:
dell-intel, the default, dell-amd, hpe-intel, hpe-amd; FLAVOURS holds each one's attribute names and values),
so that a role written against the emulator survives real hardware:

- Pending values. A PATCH of ``BIOS/Settings`` stages values; ``BIOS`` keeps showing the current ones
  until the server resets (the BIOS applies them at POST, whether the reset came through Redfish or from
  the OS rebooting: the QMP ``RESET`` event). iDRAC: ``BIOS/Settings`` shows only the pending values; while
  a BIOS job is scheduled, older firmware refuses another PATCH with HTTP 400 "Pending configuration values
  are already committed, unable to perform another set operation." (iDRAC's SYS011;
  dell/iDRAC-Redfish-Scripting#249), newer firmware adds the values to the job
  (``--idrac-second-patch append``); the OEM action ``DellManager.ClearPending`` drops the values and their
  job. iLO: ``BIOS/Settings`` shows the whole state the next boot applies, every PATCH merges into it (a
  value equal to the current one is no change), and there is no action to clear it.
- An attribute registry with dependencies. The attributes a system or workload profile governs
  (Dell: ``ProcPwrPerf``, ``ProcCStates``, ``ProcC1E``, ``ProcTurboMode``, ``MemFrequency`` unless
  ``SysProfile`` is ``Custom``) are ``ReadOnly`` on iDRAC (the registry says so under ``Dependencies``):
  a PATCH setting one is refused unless ``SysProfile`` is ``Custom`` already or in the same PATCH. On iLO
  they are ``GrayOut`` unless ``WorkloadProfile`` is ``Custom``: the PATCH is accepted, but at POST the
  workload profile puts its own values back, so the change is silently lost. Unknown names and values
  outside an enumeration are refused with HTTP 400 by both.
- The system reports its ``Manufacturer`` and ``ProcessorSummary.Model`` (``--processor-model ''``: not
  reported, as on some firmware), and the service root its ``Vendor`` (community.general adds
  ``ApplyTime: OnReset`` for Dell).
- Reset types. The system offers only the ``ResetType`` values given by ``--reset-types``; the default
  lacks ``GracefulRestart``, like many iDRAC 9 firmwares on 14th-generation servers (community.general
  then sends ``ForceRestart``). A reset type not offered is refused with HTTP 400.
- Several systems: ``--extra-system NAME`` adds a system (not wired to the VM; its pending values
  apply at a Redfish reset), for the inventory's ``bmc_resource_id``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from xml.sax.saxutils import quoteattr

import bcrypt
import flask
import libvirt
from sushy_tools.emulator import main as sushy_main
from sushy_tools.emulator.resources.systems import libvirtdriver

LOG = logging.getLogger("bigmem-lab-bmc")
SUSHY_NAMESPACE = "http://openstack.org/xmlns/libvirt/sushy"


def domain_xml(name: str, memory_mib: int, bios_attributes: dict[str, str]) -> str:
    """Test-driver domain standing for the lab server, BIOS attributes in sushy's metadata."""
    attributes = "\n".join(
        f"        <sushy:attribute name={quoteattr(key)} value={quoteattr(str(value))}/>"
        for key, value in sorted(bios_attributes.items())
    )
    half = memory_mib // 2
    return f"""<domain type='test'>
  <name>{name}</name>
  <uuid>{uuid.uuid5(uuid.NAMESPACE_DNS, name)}</uuid>
  <memory unit='MiB'>{memory_mib}</memory>
  <vcpu>2</vcpu>
  <cpu>
    <numa>
      <cell id='0' cpus='0' memory='{half}' unit='MiB'/>
      <cell id='1' cpus='1' memory='{half}' unit='MiB'/>
    </numa>
  </cpu>
  <os><type arch='x86_64'>hvm</type><boot dev='hd'/></os>
  <metadata>
    <sushy:bios xmlns:sushy='{SUSHY_NAMESPACE}'>
      <sushy:attributes>
{attributes}
      </sushy:attributes>
    </sushy:bios>
  </metadata>
</domain>"""


# ---- the BIOS as iDRAC 9 and iLO 5/6 keep it --------------------------------------------------------

ENABLED_DISABLED = ["Enabled", "Disabled"]
DELL_SYS_PROFILES = [
    "PerfPerWattOptimizedDapc",
    "PerfPerWattOptimizedOs",
    "PerfOptimized",
    "DenseCfgOptimized",
    "Custom",
]
HPE_WORKLOAD_PROFILES = [
    "GeneralPowerEfficientCompute",
    "GeneralPeakFrequencyCompute",
    "GeneralThroughputCompute",
    "HighPerformanceCompute",
    "LowLatency",
    "Custom",
]
SUSHY_REGISTRY_NAME = "BiosAttributeRegistry.v1_0_0"  # the registry file sushy-tools already lists
SYS011 = "Pending configuration values are already committed, unable to perform another set operation."


@dataclass(frozen=True)
class Flavour:
    """One BMC and BIOS family: the attribute names and values of its registry and its pending rules.

    ``governor``/``governed``: the governed attributes are writable only while the governor holds that value
    (Dell SysProfile=Custom, HPE WorkloadProfile=Custom). iDRAC marks them ReadOnly in the registry and refuses a
    PATCH setting one (unless the same PATCH sets the governor); iLO marks them GrayOut, accepts the PATCH, and at
    POST the workload profile puts its own values back unless WorkloadProfile is Custom after the reset.
    """

    name: str
    vendor: str  # the service root's Vendor (community.general adds ApplyTime: OnReset for Dell)
    manufacturer: str  # the system's Manufacturer
    processor_model: str  # the system's ProcessorSummary.Model
    registry_name: str
    enumerations: dict[str, list[str]]
    governor: tuple[str, str]
    governed: tuple[str, ...]
    read_only: tuple[str, ...] = ("SerialNumber",)

    @property
    def ilo(self) -> bool:
        return self.vendor == "HPE"

    @property
    def registry_uri(self) -> str:
        if self.ilo:  # iLO serves its registries under /redfish/v1/registrystore, linked by extref
            return f"/redfish/v1/registrystore/attributeregistries/en/{self.registry_name}"
        return f"/redfish/v1/Registries/BiosAttributeRegistry/{self.registry_name}"


# Names and values from the public iDRAC 9 and iLO 5/6 registries and BIOS dumps (roles/bigmem_bios/README.md).
FLAVOURS = {
    flavour.name: flavour
    for flavour in (
        Flavour(
            name="dell-intel",
            vendor="Dell",
            manufacturer="Dell Inc.",
            processor_model="Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz",
            registry_name="BiosAttributeRegistry.v1_0_0",
            enumerations={
                "SysProfile": DELL_SYS_PROFILES,
                "ProcPwrPerf": ["SysDbpm", "MaxPerf", "OsDbpm"],
                "ProcCStates": ENABLED_DISABLED,
                "ProcC1E": ENABLED_DISABLED,
                "ProcTurboMode": ENABLED_DISABLED,
                "MemFrequency": ["MaxPerf", "MaxReliability", "2933MHz", "2666MHz"],
                "LogicalProc": ENABLED_DISABLED,
                "SubNumaCluster": ENABLED_DISABLED,
                "NodeInterleave": ENABLED_DISABLED,
                "MemOpMode": ["OptimizerMode", "MirrorMode", "SpareMode", "FaultResilientMode"],
                "BootMode": ["Bios", "Uefi"],
            },
            governor=("SysProfile", "Custom"),
            governed=("ProcPwrPerf", "ProcCStates", "ProcC1E", "ProcTurboMode", "MemFrequency"),
        ),
        # PowerEdge R6525/R7525/R6615/XE8545: no SubNumaCluster, NodeInterleave, MemOpMode or ProcC1E.
        Flavour(
            name="dell-amd",
            vendor="Dell",
            manufacturer="Dell Inc.",
            processor_model="AMD EPYC 9654 96-Core Processor",
            registry_name="BiosAttributeRegistry.v1_0_0",
            enumerations={
                "SysProfile": DELL_SYS_PROFILES,
                "ProcPwrPerf": ["SysDbpm", "MaxPerf", "OsDbpm"],
                "ProcCStates": ENABLED_DISABLED,
                "ProcTurboMode": ENABLED_DISABLED,
                "MemFrequency": ["MaxPerf", "MaxReliability", "4800MHz", "4400MHz"],
                "LogicalProc": ENABLED_DISABLED,
                "NumaNodesPerSocket": ["0", "1", "2", "4"],
                "CcxAsNumaDomain": ENABLED_DISABLED,
                "BootMode": ["Bios", "Uefi"],
            },
            governor=("SysProfile", "Custom"),
            governed=("ProcPwrPerf", "ProcCStates", "ProcTurboMode", "MemFrequency"),
        ),
        Flavour(
            name="hpe-intel",
            vendor="HPE",
            manufacturer="HPE",
            processor_model="Intel(R) Xeon(R) Platinum 8480+",
            registry_name="BiosAttributeRegistryU54.v1_2_10",
            enumerations={
                "WorkloadProfile": HPE_WORKLOAD_PROFILES,
                "PowerRegulator": ["DynamicPowerSavings", "StaticLowPower", "StaticHighPerf", "OsControl"],
                "MinProcIdlePower": ["C6", "C1E", "NoCStates"],
                "ProcTurbo": ENABLED_DISABLED,
                "ProcHyperthreading": ENABLED_DISABLED,
                "SubNumaClustering": ENABLED_DISABLED,
                "NodeInterleaving": ENABLED_DISABLED,
                "EnergyPerfBias": ["MaxPerf", "BalancedPerf", "BalancedPower", "MaxPower"],
                "AdvancedMemProtection": [
                    "AdvancedEcc",
                    "OnlineSpareAdvancedEcc",
                    "MirroredAdvancedEcc",
                    "FastFaultTolerantADDDC",
                ],
                "BootMode": ["LegacyBios", "Uefi"],
            },
            governor=("WorkloadProfile", "Custom"),
            governed=("PowerRegulator", "MinProcIdlePower", "ProcTurbo", "EnergyPerfBias"),
        ),
        # ProLiant DL325/DL385 Gen10 Plus, Gen11: ProcAMDBoost, ProcSMT, NumaMemoryDomainsPerSocket,
        # AmdMemoryInterleaving; no EnergyPerfBias or AdvancedMemProtection; PowerRegulator as on Gen11.
        Flavour(
            name="hpe-amd",
            vendor="HPE",
            manufacturer="HPE",
            processor_model="AMD EPYC 9554 64-Core Processor",
            registry_name="BiosAttributeRegistryA55.v1_1_60",
            enumerations={
                "WorkloadProfile": HPE_WORKLOAD_PROFILES,
                "PowerRegulator": ["StaticHighPerf", "OsControl"],
                "MinProcIdlePower": ["C6", "NoCStates"],
                "ProcAMDBoost": ENABLED_DISABLED,
                "ProcSMT": ENABLED_DISABLED,
                "NumaMemoryDomainsPerSocket": [
                    "Auto",
                    "OneMemoryDomainPerSocket",
                    "TwoMemoryDomainsPerSocket",
                    "FourMemoryDomainsPerSocket",
                ],
                "AmdMemoryInterleaving": ["Auto", "Disabled"],
                "BootMode": ["LegacyBios", "Uefi"],
            },
            governor=("WorkloadProfile", "Custom"),
            governed=("PowerRegulator", "MinProcIdlePower", "ProcAMDBoost"),
        ),
    )
}


def system_uuid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, name))


def redfish_error(status: int, message_id: str, message: str, resolution: str = "") -> flask.Response:
    body = {
        "error": {
            "code": "Base.1.12.GeneralError",
            "message": message,
            "@Message.ExtendedInfo": [
                {
                    "MessageId": message_id,
                    "Message": message,
                    "Resolution": resolution,
                    "Severity": "Critical",
                }
            ],
        }
    }
    return flask.Response(json.dumps(body), status=status, content_type="application/json")


def governed_dependencies(flavour: Flavour) -> list[dict]:
    """Registry ``Dependencies``: each governed attribute is ReadOnly (iDRAC) or GrayOut (iLO) while the governor
    does not hold its value."""
    attribute, value = flavour.governor
    return [
        {
            "DependencyFor": name,
            "Type": "Map",
            "Dependency": {
                "MapFrom": [
                    {
                        "MapFromAttribute": attribute,
                        "MapFromProperty": "CurrentValue",
                        "MapFromCondition": "NEQ",
                        "MapFromValue": value,
                    }
                ],
                "MapToAttribute": name,
                "MapToProperty": "GrayOut" if flavour.ilo else "ReadOnly",
                "MapToValue": True,
            },
        }
        for name in flavour.governed
    ]


def governed_locked(flavour: Flavour, values: dict) -> bool:
    attribute, value = flavour.governor
    return values.get(attribute) != value


def read_only_under(flavour: Flavour, values: dict) -> set[str]:
    """Attributes a PATCH may not change when the BIOS holds ``values``."""
    locked = set(flavour.read_only)
    if not flavour.ilo and governed_locked(flavour, values):
        locked.update(flavour.governed)
    return locked


def registry(flavour: Flavour, current: dict) -> dict:
    """The attribute registry of a BIOS that currently holds ``current`` (ReadOnly follows the dependencies)."""
    locked = read_only_under(flavour, current)
    grayed = set(flavour.governed) if flavour.ilo and governed_locked(flavour, current) else set()
    entries = []
    for name in sorted(current):
        entry = {
            "AttributeName": name,
            "DisplayName": name,
            "ReadOnly": name in locked,
            "Hidden": False,
            "Immutable": name in flavour.read_only,
            "CurrentValue": current[name],
        }
        if flavour.ilo:
            entry["GrayOut"] = name in grayed
        if name in flavour.enumerations:
            entry.update(
                Type="Enumeration",
                Value=[
                    {"ValueName": value, "ValueDisplayName": value} for value in flavour.enumerations[name]
                ],
            )
        else:
            entry["Type"] = "String"
        entries.append(entry)
    return {
        "@odata.id": flavour.registry_uri,
        "@odata.type": "#AttributeRegistry.v1_3_0.AttributeRegistry",
        "Id": flavour.registry_name,
        "Name": "BIOS Attribute Registry",
        "Language": "en",
        "OwningEntity": flavour.vendor,
        "RegistryVersion": flavour.registry_name.split(".", 1)[1],
        "RegistryEntries": {"Attributes": entries, "Dependencies": governed_dependencies(flavour)},
    }


def refuse_patch(
    flavour: Flavour, current: dict, pending: dict, attributes, second_patch: str = "refuse"
) -> tuple[str, str] | None:
    """(MessageId, message) when the BMC would refuse this PATCH of BIOS/Settings, else None.

    iDRAC: while a BIOS job is scheduled (values pending), older firmware refuses another PATCH (SYS011),
    newer firmware (``second_patch="append"``) adds the values to the scheduled job. iLO merges them always.
    """
    if pending and not flavour.ilo and second_patch == "refuse":
        return "IDRAC.2.8.SYS011", SYS011
    if not isinstance(attributes, dict) or not attributes:
        return "Base.1.12.PropertyMissing", "The request body must hold a non-empty Attributes object."
    for name, value in attributes.items():
        if name not in current:
            return "Base.1.12.PropertyUnknown", f"The property {name} is not in the list of valid properties."
        if name in flavour.enumerations and value not in flavour.enumerations[name]:
            return (
                "Base.1.12.PropertyValueNotInList",
                f"The value {value} for the property {name} is not in the list of acceptable values.",
            )
    after = {**current, **pending, **attributes}
    for name in attributes:
        if name in read_only_under(flavour, after) and attributes[name] != current[name]:
            why = f" unless {'='.join(flavour.governor)}" if name in flavour.governed else ""
            return "Base.1.12.PropertyNotWritable", f"The attribute {name} is read-only{why}."
    return None


class PendingBios:
    """Pending BIOS values per system, applied when the system resets."""

    def __init__(self, system_names: list[str], flavour: Flavour):
        self.flavour = flavour
        self.lock = threading.Lock()
        self.pending: dict[str, dict] = {}  # system UUID -> pending attributes
        self.ids = {}  # name or UUID -> UUID (sushy-tools answers a name with a redirect to the UUID)
        for name in system_names:
            self.ids[name] = self.ids[system_uuid(name)] = system_uuid(name)

    def id_of(self, identity: str) -> str:
        return self.ids.get(identity, identity)

    def apply(self, driver, identity: str, why: str) -> None:
        with self.lock:
            pending = self.pending.pop(identity, {})
        if not pending:
            return
        if self.flavour.ilo:
            after = {**driver.get_bios(identity), **pending}
            if governed_locked(self.flavour, after):
                # The workload profile sets the governed attributes itself at POST: changes to them are lost.
                lost = {name: pending.pop(name) for name in self.flavour.governed if name in pending}
                if lost:
                    LOG.info(
                        "system %s: workload profile %s overrides %s at POST",
                        identity,
                        after.get(self.flavour.governor[0]),
                        lost,
                    )
        if pending:
            driver.set_bios(identity, pending)
        LOG.info("system %s: applied pending BIOS values %s at %s", identity, pending, why)


def install_bios(
    app,
    system_names: list[str],
    reset_types: list[str],
    flavour: Flavour,
    second_patch: str,
    processor_model: str,
) -> PendingBios:
    """Replace sushy-tools' BIOS views by iDRAC- or iLO-like ones (see the module docstring)."""
    bios_state = PendingBios(system_names, flavour)
    key = bios_state.id_of
    jobs = itertools.count(int(time.time()))

    def json_view(endpoint, edit):
        original = app.view_functions[endpoint]

        def view(*args, **kwargs):
            response = original(*args, **kwargs)
            if flask.request.method != "GET" or response.status_code != 200:
                return response
            data = json.loads(response.get_data())
            edit(data, *args, **kwargs)
            return flask.Response(json.dumps(data), status=200, content_type="application/json")

        app.view_functions[endpoint] = view

    def root(data):
        data["Vendor"] = flavour.vendor

    def system(data, identity):
        data["Manufacturer"] = flavour.manufacturer
        summary = data.setdefault("ProcessorSummary", {})
        summary["Count"] = 2
        if processor_model:
            summary["Model"] = processor_model
        reset = data.get("Actions", {}).get("#ComputerSystem.Reset")
        if reset is not None:
            reset["ResetType@Redfish.AllowableValues"] = reset_types

    def bios(data, identity):
        data["AttributeRegistry"] = flavour.registry_name

    json_view("root_resource", root)
    json_view("system_resource", system)
    json_view("bios", bios)

    def registry_file(data):
        data["Id"] = data["Registry"] = flavour.registry_name
        uri = {"extref": flavour.registry_uri} if flavour.ilo else flavour.registry_uri
        data["Location"] = [{"Language": "en", "Uri": uri}]

    json_view("bios_attribute_registry_file", registry_file)
    if flavour.registry_name != SUSHY_REGISTRY_NAME:  # sushy-tools serves only its own registry file
        app.add_url_rule(
            f"/redfish/v1/Registries/{flavour.registry_name}",
            "flavour_registry_file",
            lambda: app.view_functions["bios_attribute_registry_file"](),
        )

    @app.route(flavour.registry_uri)
    def bios_registry_entries():
        # One registry for the BMC; its ReadOnly flags follow the lab system's current values.
        current = app.systems.get_bios(system_uuid(system_names[0]))
        return flask.Response(json.dumps(registry(flavour, current)), content_type="application/json")

    original_settings = app.view_functions["bios_settings"]

    def bios_settings(identity):
        if flask.request.method == "GET":
            response = original_settings(identity)  # access checks, 404 for an unknown system
            if response.status_code != 200:
                return response
            data = json.loads(response.get_data())
            with bios_state.lock:
                pending = dict(bios_state.pending.get(key(identity), {}))
            if flavour.ilo:
                # iLO shows the whole state the next boot applies; no action clears it (PATCH values back).
                data["Attributes"] = {**app.systems.get_bios(identity), **pending}
                data.pop("Actions", None)
            else:
                data["Attributes"] = pending  # iDRAC shows only the pending values
                target = f"/redfish/v1/Systems/{identity}/BIOS/Settings/Actions/Oem/DellManager.ClearPending"
                data["Actions"] = {"Oem": {"#DellManager.ClearPending": {"target": target}}}
            data["@Redfish.SettingsApplyTime"] = {"ApplyTime": "OnReset"}
            return flask.Response(json.dumps(data), content_type="application/json")
        body = flask.request.get_json(silent=True) or {}
        attributes = body.get("Attributes")
        current = app.systems.get_bios(identity)
        with bios_state.lock:
            pending = bios_state.pending.get(key(identity), {})
            refused = refuse_patch(flavour, current, pending, attributes, second_patch)
            if refused is None:
                merged = {**pending, **{name: str(value) for name, value in attributes.items()}}
                # A value equal to the current one is no change: iLO drops it from the future state.
                merged = {name: value for name, value in merged.items() if value != str(current[name])}
                if merged:
                    bios_state.pending[key(identity)] = merged
                else:
                    bios_state.pending.pop(key(identity), None)
        if refused is not None:
            LOG.info("system %s: PATCH of BIOS/Settings %s refused: %s", identity, attributes, refused[1])
            return redfish_error(400, *refused)
        LOG.info(
            "system %s: BIOS values %s pending until the next reset (ApplyTime %s)",
            identity,
            attributes,
            body.get("@Redfish.SettingsApplyTime", {}).get("ApplyTime", "none given"),
        )
        if flavour.ilo:
            info = {
                "MessageId": "iLO.2.15.SystemResetRequired",
                "Message": "One or more properties were changed.",
            }
            return flask.Response(
                json.dumps({"error": {"code": "iLO.0.10.ExtendedInfo", "@Message.ExtendedInfo": [info]}}),
                status=200,
                content_type="application/json",
            )
        return flask.Response(
            status=202, headers={"Location": f"/redfish/v1/Managers/iDRAC.Embedded.1/Jobs/JID_{next(jobs)}"}
        )

    app.view_functions["bios_settings"] = bios_settings

    @app.route(
        "/redfish/v1/Systems/<identity>/BIOS/Settings/Actions/Oem/DellManager.ClearPending", methods=["POST"]
    )
    def bios_clear_pending(identity):
        if flavour.ilo:
            flask.abort(404)
        app.systems.get_bios(identity)  # 404 for an unknown system
        with bios_state.lock:
            dropped = bios_state.pending.pop(key(identity), None)
        if not dropped:
            return redfish_error(400, "IDRAC.2.8.SYS046", "There are no pending values to be cleared.")
        LOG.info("system %s: pending BIOS values %s cleared (and their job deleted)", identity, dropped)
        return flask.Response(status=200)

    original_reset = app.view_functions["system_reset_action"]

    def system_reset_action(identity):
        reset_type = (flask.request.get_json(silent=True) or {}).get("ResetType")
        if reset_type not in reset_types:
            return redfish_error(
                400,
                "Base.1.12.ActionParameterNotSupported",
                f"The parameter ResetType={reset_type} is not supported by this system: "
                f"{', '.join(reset_types)}.",
            )
        return original_reset(identity)

    app.view_functions["system_reset_action"] = system_reset_action
    return bios_state


class Qmp:
    """Minimal QMP client: one short connection per command."""

    def __init__(self, path: str):
        self.path = path

    def execute(self, command: str) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(self.path)
            stream = sock.makefile("rwb")
            json.loads(stream.readline())  # greeting
            for name in ("qmp_capabilities", command):
                stream.write(json.dumps({"execute": name}).encode() + b"\n")
                stream.flush()
                while True:
                    reply = json.loads(stream.readline())
                    if "event" not in reply:
                        break
                if "error" in reply:
                    raise RuntimeError(f"QMP {name}: {reply['error']}")
            return reply.get("return", {})

    def status(self) -> str:
        return self.execute("query-status").get("status", "unknown")

    def power_on(self) -> None:
        if self.status() in ("shutdown", "paused", "guest-panicked"):
            self.execute("system_reset")
            self.execute("cont")

    def graceful_restart(self, timeout: float = 300) -> None:
        self.execute("system_powerdown")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status() == "shutdown":
                break
            time.sleep(1)
        else:
            LOG.warning("guest did not shut down within %ss; resetting it", timeout)
        self.execute("system_reset")
        self.execute("cont")


def watch_resets(path: str, on_reset) -> None:
    """Follow QEMU's QMP events on their own monitor socket; call on_reset(data) at every RESET (the
    guest rebooting itself, or a reset sent over the other socket). Runs for the life of the process."""
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                stream = sock.makefile("rwb")
                json.loads(stream.readline())  # greeting
                stream.write(b'{"execute": "qmp_capabilities"}\n')
                stream.flush()
                for line in stream:
                    message = json.loads(line)
                    if message.get("event") == "RESET":
                        on_reset(message.get("data", {}))
        except (OSError, ValueError) as problem:
            LOG.debug("QMP event socket %s: %s", path, problem)
        time.sleep(1)


RESTARTS = ("ForceRestart", "GracefulRestart", "PowerCycle", "On", "ForceOn")


def wire_power(dell: PendingBios, qmp: Qmp | None, system_name: str, events: bool) -> None:
    """Forward the VM's power actions to QEMU; apply pending BIOS values when a system resets (for the VM:
    at QEMU's RESET event when events are watched, else at the Redfish action)."""
    original = libvirtdriver.LibvirtDriver.set_power_state

    def set_power_state(self, identity, state):
        was = self.get_power_state(identity)
        original(self, identity, state)
        wired = qmp is not None and identity in (
            system_name,
            str(uuid.uuid5(uuid.NAMESPACE_DNS, system_name)),
        )
        resets = state in RESTARTS and not (state in ("On", "ForceOn") and was == "On")
        if resets and not (wired and events):
            dell.apply(self, dell.id_of(identity), f"Redfish {state}")
        if not wired:
            return
        LOG.info("forwarding %s to the QEMU VM", state)
        if state == "ForceRestart":
            qmp.execute("system_reset")
        elif state == "GracefulRestart":
            threading.Thread(target=qmp.graceful_restart, daemon=True).start()
        elif state == "GracefulShutdown":
            qmp.execute("system_powerdown")
        elif state == "ForceOff":
            qmp.execute("stop")
        elif state in ("On", "ForceOn"):
            qmp.power_on()
        elif state == "Nmi":
            qmp.execute("inject-nmi")

    libvirtdriver.LibvirtDriver.set_power_state = set_power_state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--auth-file", required=True, help="written here from --username/--password")
    parser.add_argument("--username", required=True)
    parser.add_argument("--password-file", required=True)
    parser.add_argument("--bios-attributes", required=True, help="JSON object: initial BIOS attributes")
    parser.add_argument("--system-name", default="bigmem-lab-01")
    parser.add_argument("--memory-mib", type=int, default=2048)
    parser.add_argument(
        "--qmp-socket", help="QEMU QMP socket of the lab VM; without it power is bookkeeping only"
    )
    parser.add_argument(
        "--qmp-events-socket",
        help="a second QMP socket of the VM, watched for RESET events (pending BIOS values apply)",
    )
    parser.add_argument(
        "--extra-system",
        action="append",
        default=[],
        help="another system this BMC manages (same BIOS attributes, not wired to the VM)",
    )
    parser.add_argument(
        "--reset-types",
        default="On,ForceOff,GracefulShutdown,ForceRestart,Nmi",
        help="ResetType values the systems offer (default: no GracefulRestart, like many iDRAC 9)",
    )
    parser.add_argument(
        "--flavour", choices=sorted(FLAVOURS), default="dell-intel", help="BMC and BIOS family (FLAVOURS)"
    )
    parser.add_argument(
        "--idrac-second-patch",
        choices=["refuse", "append"],
        default="refuse",
        help="iDRAC firmware's answer to a PATCH while a BIOS job is scheduled: refuse (SYS011, older) or append",
    )
    parser.add_argument(
        "--processor-model",
        help="the system's ProcessorSummary.Model (default: the flavour's; empty: not reported)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    with open(args.password_file, encoding="utf-8") as handle:
        password = handle.read().strip()
    digest = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
    with open(args.auth_file, "w", encoding="utf-8") as handle:
        handle.write(f"{args.username}:{digest}\n")
    with open(args.bios_attributes, encoding="utf-8") as handle:
        bios_attributes = json.load(handle)

    uri = "test:///default"
    keeper = libvirt.open(uri)  # keeps the test driver's state alive; never closed
    for domain in keeper.listAllDomains():
        if domain.isActive():
            domain.destroy()
        domain.undefine()
    systems = [args.system_name, *args.extra_system]
    for name in systems:
        keeper.defineXML(domain_xml(name, args.memory_mib, bios_attributes)).create()

    app = sushy_main.app
    flavour = FLAVOURS[args.flavour]
    dell = install_bios(
        app,
        systems,
        [value for value in args.reset_types.split(",") if value],
        flavour,
        args.idrac_second_patch,
        flavour.processor_model if args.processor_model is None else args.processor_model,
    )
    wire_power(
        dell,
        Qmp(args.qmp_socket) if args.qmp_socket else None,
        args.system_name,
        events=bool(args.qmp_events_socket),
    )
    if args.qmp_events_socket:
        resets = {"last": float("-inf")}

        def on_reset(data):
            # The firmware resets the machine once more right after a reset: one reboot, one line.
            now = time.monotonic()
            if now - resets["last"] > 10:
                LOG.info("the VM reset (%s)", data.get("reason", "reset"))
            resets["last"] = now
            dell.apply(
                app.systems, system_uuid(args.system_name), f"the VM's reset ({data.get('reason', 'reset')})"
            )

        threading.Thread(target=watch_resets, args=(args.qmp_events_socket, on_reset), daemon=True).start()
    app.configure(extra_config={"SUSHY_EMULATOR_AUTH_FILE": args.auth_file})
    app.config.update(
        SUSHY_EMULATOR_LIBVIRT_URI=uri,
        SUSHY_EMULATOR_IGNORE_BOOT_DEVICE=True,
    )
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.cert, args.key)
    LOG.info("Redfish emulator for %s on https://%s:%s", args.system_name, args.listen, args.port)
    app.run(host=args.listen, port=args.port, ssl_context=context, threaded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
