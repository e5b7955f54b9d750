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
BIOS behaves like a Dell iDRAC 9's, so that a role written against the emulator survives real hardware:

- Pending values. A PATCH of ``BIOS/Settings`` stages values; ``BIOS`` keeps showing the current ones and
  ``BIOS/Settings`` shows only the pending ones, until the server resets (the BIOS applies them at POST,
  whether the reset came through Redfish or from the OS rebooting: the QMP ``RESET`` event). While values
  are pending a second PATCH is refused with HTTP 400 "Pending configuration values are already
  committed, unable to perform another set operation." (iDRAC's SYS011; dell/iDRAC-Redfish-Scripting#249).
  The Dell OEM action ``DellManager.ClearPending`` on ``BIOS/Settings`` drops them.
- An attribute registry with dependencies. ``ProcPwrPerf``, ``ProcCStates``, ``ProcC1E``,
  ``ProcTurboMode`` and ``MemFrequency`` are read-only unless ``SysProfile`` is ``Custom`` (the registry
  says so under ``Dependencies`` and in ``ReadOnly``); a PATCH setting one of them is refused unless
  ``SysProfile`` is ``Custom`` already or in the same PATCH. Unknown names and values outside an
  enumeration are refused with HTTP 400, as iDRAC does.
- Reset types. The system offers only the ``ResetType`` values given by ``--reset-types``; the default
  lacks ``GracefulRestart``, like many iDRAC 9 firmwares on 14th-generation servers (community.general
  then sends ``ForceRestart``). A reset type not offered is refused with HTTP 400.
- ``Vendor: Dell`` in the service root (community.general adds ``ApplyTime: OnReset`` for Dell).
- Several systems: ``--extra-system NAME`` adds a system (not wired to the VM; its pending values
  apply at a Redfish reset), for the inventory's ``bmc_resource_id``.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time
import uuid
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


# ---- the BIOS as iDRAC 9 keeps it ------------------------------------------------------------------

REGISTRY_NAME = "BiosAttributeRegistry.v1_0_0"  # the registry file sushy-tools already lists
REGISTRY_URI = f"/redfish/v1/Registries/BiosAttributeRegistry/{REGISTRY_NAME}"  # where iDRAC serves it
CUSTOM_ONLY = ("ProcPwrPerf", "ProcCStates", "ProcC1E", "ProcTurboMode", "MemFrequency")
ENABLED_DISABLED = ["Enabled", "Disabled"]
ENUMERATIONS = {
    "SysProfile": [
        "PerfPerWattOptimizedDapc",
        "PerfPerWattOptimizedOs",
        "PerfOptimized",
        "DenseCfgOptimized",
        "Custom",
    ],
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
}
READ_ONLY = ("SerialNumber",)
SYS011 = "Pending configuration values are already committed, unable to perform another set operation."


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


def custom_only_dependencies() -> list[dict]:
    """Registry ``Dependencies``: each CUSTOM_ONLY attribute is read-only while SysProfile is not Custom."""
    return [
        {
            "DependencyFor": name,
            "Type": "Map",
            "Dependency": {
                "MapFrom": [
                    {
                        "MapFromAttribute": "SysProfile",
                        "MapFromProperty": "CurrentValue",
                        "MapFromCondition": "NEQ",
                        "MapFromValue": "Custom",
                    }
                ],
                "MapToAttribute": name,
                "MapToProperty": "ReadOnly",
                "MapToValue": True,
            },
        }
        for name in CUSTOM_ONLY
    ]


def read_only_under(values: dict) -> set[str]:
    """Attributes that are read-only when the BIOS holds ``values``."""
    locked = set(READ_ONLY)
    if values.get("SysProfile") != "Custom":
        locked.update(CUSTOM_ONLY)
    return locked


def registry(current: dict) -> dict:
    """The attribute registry of a BIOS that currently holds ``current`` (ReadOnly follows the dependencies)."""
    locked = read_only_under(current)
    entries = []
    for name in sorted(current):
        entry = {
            "AttributeName": name,
            "DisplayName": name,
            "ReadOnly": name in locked,
            "Hidden": False,
            "Immutable": name in READ_ONLY,
            "CurrentValue": current[name],
        }
        if name in ENUMERATIONS:
            entry.update(
                Type="Enumeration",
                Value=[{"ValueName": value, "ValueDisplayName": value} for value in ENUMERATIONS[name]],
            )
        else:
            entry["Type"] = "String"
        entries.append(entry)
    return {
        "@odata.id": REGISTRY_URI,
        "@odata.type": "#AttributeRegistry.v1_3_0.AttributeRegistry",
        "Id": REGISTRY_NAME,
        "Name": "BIOS Attribute Registry",
        "Language": "en",
        "OwningEntity": "Dell",
        "RegistryVersion": "1.0.0",
        "RegistryEntries": {"Attributes": entries, "Dependencies": custom_only_dependencies()},
    }


def refuse_patch(current: dict, pending: dict, attributes) -> tuple[str, str] | None:
    """(MessageId, message) when iDRAC would refuse this PATCH of BIOS/Settings, else None."""
    if pending:
        return "IDRAC.2.8.SYS011", SYS011
    if not isinstance(attributes, dict) or not attributes:
        return "Base.1.12.PropertyMissing", "The request body must hold a non-empty Attributes object."
    for name, value in attributes.items():
        if name not in current:
            return "Base.1.12.PropertyUnknown", f"The property {name} is not in the list of valid properties."
        if name in ENUMERATIONS and value not in ENUMERATIONS[name]:
            return (
                "Base.1.12.PropertyValueNotInList",
                f"The value {value} for the property {name} is not in the list of acceptable values.",
            )
    after = {**current, **attributes}
    for name in attributes:
        if name in read_only_under(after) and attributes[name] != current[name]:
            why = " unless SysProfile is Custom" if name in CUSTOM_ONLY else ""
            return "IDRAC.2.8.SYS410", f"The attribute {name} is read-only{why}."
    return None


class DellBios:
    """Pending BIOS values per system, applied when the system resets."""

    def __init__(self, system_names: list[str]):
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
            if pending:
                driver.set_bios(identity, pending)
                LOG.info("system %s: applied pending BIOS values %s at %s", identity, pending, why)


def install_dell_bios(app, system_names: list[str], reset_types: list[str]) -> DellBios:
    """Replace sushy-tools' BIOS views by iDRAC-like ones (see the module docstring)."""
    dell = DellBios(system_names)
    key = dell.id_of

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
        data["Vendor"] = "Dell"

    def system(data, identity):
        reset = data.get("Actions", {}).get("#ComputerSystem.Reset")
        if reset is not None:
            reset["ResetType@Redfish.AllowableValues"] = reset_types

    def bios(data, identity):
        data["AttributeRegistry"] = REGISTRY_NAME

    json_view("root_resource", root)
    json_view("system_resource", system)
    json_view("bios", bios)

    def registry_file(data):
        data["Location"] = [{"Language": "en", "Uri": REGISTRY_URI}]

    json_view("bios_attribute_registry_file", registry_file)

    @app.route(REGISTRY_URI)
    def bios_registry_entries():
        # One registry for the BMC, as on iDRAC; its ReadOnly flags follow the lab system's current values.
        current = app.systems.get_bios(system_uuid(system_names[0]))
        return flask.Response(json.dumps(registry(current)), content_type="application/json")

    original_settings = app.view_functions["bios_settings"]

    def bios_settings(identity):
        if flask.request.method == "GET":
            response = original_settings(identity)  # access checks, 404 for an unknown system
            if response.status_code != 200:
                return response
            data = json.loads(response.get_data())
            with dell.lock:
                data["Attributes"] = dict(dell.pending.get(key(identity), {}))
            data["Actions"] = {
                "Oem": {
                    "#DellManager.ClearPending": {
                        "target": f"/redfish/v1/Systems/{identity}/BIOS/Settings/Actions/Oem/DellManager.ClearPending"
                    }
                }
            }
            data["@Redfish.SettingsApplyTime"] = {"ApplyTime": "OnReset"}
            return flask.Response(json.dumps(data), content_type="application/json")
        body = flask.request.get_json(silent=True) or {}
        attributes = body.get("Attributes")
        current = app.systems.get_bios(identity)
        with dell.lock:
            refused = refuse_patch(current, dell.pending.get(key(identity), {}), attributes)
            if refused is None:
                dell.pending[key(identity)] = {name: str(value) for name, value in attributes.items()}
        if refused is not None:
            LOG.info("system %s: PATCH of BIOS/Settings %s refused: %s", identity, attributes, refused[1])
            return redfish_error(400, *refused)
        LOG.info(
            "system %s: BIOS values %s pending until the next reset (ApplyTime %s)",
            identity,
            attributes,
            body.get("@Redfish.SettingsApplyTime", {}).get("ApplyTime", "none given"),
        )
        return flask.Response(
            status=202,
            headers={"Location": f"/redfish/v1/Managers/iDRAC.Embedded.1/Jobs/JID_{int(time.time())}"},
        )

    app.view_functions["bios_settings"] = bios_settings

    @app.route(
        "/redfish/v1/Systems/<identity>/BIOS/Settings/Actions/Oem/DellManager.ClearPending", methods=["POST"]
    )
    def bios_clear_pending(identity):
        app.systems.get_bios(identity)  # 404 for an unknown system
        with dell.lock:
            dropped = dell.pending.pop(key(identity), None)
        if not dropped:
            return redfish_error(400, "IDRAC.2.8.SYS046", "There are no pending values to be cleared.")
        LOG.info("system %s: pending BIOS values %s cleared", identity, dropped)
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
    return dell


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


def wire_power(dell: DellBios, qmp: Qmp | None, system_name: str, events: bool) -> None:
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
    dell = install_dell_bios(app, systems, [value for value in args.reset_types.split(",") if value])
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
