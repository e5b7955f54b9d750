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


def wire_power_to_qemu(qmp: Qmp, system_name: str) -> None:
    original = libvirtdriver.LibvirtDriver.set_power_state

    def set_power_state(self, identity, state):
        original(self, identity, state)
        if identity not in (system_name, str(uuid.uuid5(uuid.NAMESPACE_DNS, system_name))):
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
    parser.add_argument("--qmp-socket", help="QEMU QMP socket of the lab VM; without it power is bookkeeping only")
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
    keeper.defineXML(domain_xml(args.system_name, args.memory_mib, bios_attributes)).create()

    if args.qmp_socket:
        wire_power_to_qemu(Qmp(args.qmp_socket), args.system_name)

    app = sushy_main.app
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
