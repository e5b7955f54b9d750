"""Lab hosts from the inventory (read with Ansible's own parser), SSH connections to them, and the folder
each job keeps on a host. Exit code 4 when a host cannot be reached or refuses the login."""

from __future__ import annotations

import io
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigmem_train.errors import BadInput, BigmemError

EXIT_UNREACHABLE = 4

DEFAULT_REMOTE_DIR = "bigmem-train"
DEFAULT_EXECUTABLE = "bigmem-train"
DEFAULT_IMAGE = "bigmem-train"
DEFAULT_CONNECT_TIMEOUT = 10.0
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class Unreachable(BigmemError):
    """The host cannot be reached, or it refuses the login (exit 4)."""

    exit_code = EXIT_UNREACHABLE


# --------------------------------------------------------------------------------------------------
# Inventory


@dataclass(frozen=True)
class RemoteHost:
    """One inventory host, with the connection settings Ansible would use for it."""

    name: str
    address: str
    port: int
    user: str | None
    key_file: str | None
    connection: str
    variables: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def remote_dir(self) -> str:
        folder = str(self.variables.get("bigmem_train_remote_dir") or DEFAULT_REMOTE_DIR)
        # ssh and sftp both start in the login's home; "~/x" is spelled "x" so quoting stays simple.
        return folder[2:] if folder.startswith("~/") else folder

    @property
    def executable(self) -> str:
        return str(self.variables.get("bigmem_train_executable") or DEFAULT_EXECUTABLE)

    @property
    def label(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{self.name} ({user}{self.address}:{self.port})"


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, RemoteHost]
    groups: dict[str, list[str]]

    def host(self, name: str) -> RemoteHost:
        if name not in self.hosts:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise BadInput(f"host {name!r} is not in inventory {self.path} (hosts: {known})")
        return self.hosts[name]

    def targets(self, name: str) -> list[RemoteHost]:
        """A host, or every host of a group, in inventory order."""
        if name in self.hosts:
            return [self.hosts[name]]
        if name in self.groups and self.groups[name]:
            return [self.hosts[host] for host in self.groups[name]]
        known = ", ".join(sorted(self.hosts)) or "none"
        groups = (
            ", ".join(sorted(group for group in self.groups if group not in {"all", "ungrouped"})) or "none"
        )
        raise BadInput(
            f"{name!r} is neither a host nor a group of inventory {self.path} "
            f"(hosts: {known}; groups: {groups})"
        )

    def hostvars(self) -> dict[str, dict[str, Any]]:
        return {name: host.variables for name, host in self.hosts.items()}


def _plain(value: Any) -> Any:
    """Ansible's tagged strings and lazy containers as plain Python values."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value)


def load_inventory(path: str | Path) -> Inventory:
    """Parse an Ansible inventory (INI or YAML, with its group_vars/ and host_vars/) with Ansible itself."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise BadInput(f"inventory {path} does not exist (give one with --inventory)")
    try:  # Ansible comes with the optional "ops" extra.
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.vars.manager import VariableManager
    except ImportError:
        raise BadInput(
            "remote commands need Ansible's inventory parser: run `bash scripts/setup.sh --ops` in the kit's "
            "folder (the pinned Ansible and Fabric, into .venv)"
        ) from None
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(path)])
    variables = VariableManager(loader=loader, inventory=inventory)
    hosts: dict[str, RemoteHost] = {}
    for host in inventory.get_hosts():
        merged = variables.get_vars(host=host, include_hostvars=False)
        wanted = {
            key: _plain(value)
            for key, value in merged.items()
            if key.startswith(("ansible_", "bigmem_")) and key not in {"ansible_facts", "ansible_play_hosts"}
        }
        hosts[host.name] = _remote_host(host.name, wanted, path)
    if not hosts:
        reason = _why_unparsed(path, loader)
        raise BadInput(
            f"inventory {path} has no hosts: {reason}"
            if reason
            else f"inventory {path} has no hosts (is it an Ansible INI or YAML inventory?)"
        )
    groups = {name: [host.name for host in group.get_hosts()] for name, group in inventory.groups.items()}
    return Inventory(path=path, hosts=hosts, groups=groups)


def _why_unparsed(path: Path, loader: Any) -> str:
    """Ansible's own reason an inventory file gave no hosts, from its INI or YAML plugin ('' if it parses:
    then it just has none). The inventory manager only warns, and not with the reason."""
    from ansible.inventory.data import InventoryData
    from ansible.plugins.loader import inventory_loader

    plugin = inventory_loader.get("yaml" if path.suffix in (".yml", ".yaml") else "ini")
    try:
        plugin.parse(InventoryData(), loader, str(path.resolve()))
    except Exception as error:  # Ansible's parser errors, and what its INI parser lets through
        reason = str(error).removeprefix("Failed to parse inventory: ").splitlines()[0]
        if "unpack" in reason:  # a section header missing its bracket, read as a host line
            reason = "a line Ansible cannot read (an unclosed [section]?)"
        return reason
    return ""


def _remote_host(name: str, variables: dict[str, Any], inventory_path: Path) -> RemoteHost:
    address = variables.get("ansible_host") or variables.get("ansible_ssh_host") or name
    port_value = variables.get("ansible_port") or variables.get("ansible_ssh_port") or 22
    try:
        port = int(port_value)
    except (TypeError, ValueError):
        raise BadInput(
            f"inventory {inventory_path}: host {name} has ansible_port {port_value!r}, not a number"
        ) from None
    user = variables.get("ansible_user") or variables.get("ansible_ssh_user")
    key_file = variables.get("ansible_ssh_private_key_file") or variables.get("ansible_private_key_file")
    if key_file:
        key_path = Path(str(key_file)).expanduser()
        if not key_path.is_absolute():
            # Ansible resolves a relative key path against the directory it is run from; the inventory's
            # folder is the stable choice for a file that travels with it.
            key_path = inventory_path.parent / key_path
        key_file = str(key_path)
    return RemoteHost(
        name=name,
        address=str(address),
        port=port,
        user=str(user) if user else None,
        key_file=key_file,
        connection=str(variables.get("ansible_connection") or "ssh"),
        variables=variables,
    )


# --------------------------------------------------------------------------------------------------
# Connections


@contextmanager
def connect(host: RemoteHost, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Iterator[Any]:
    """An open Fabric connection to ``host``; Unreachable (exit 4) with one line when there is none."""
    # Fabric and Paramiko come with the optional "ops" extra; a host that only trains does without them.
    import fabric
    import paramiko

    if host.connection not in {"ssh", "paramiko", "smart"}:
        raise BadInput(
            f"host {host.name} uses ansible_connection={host.connection}; remote commands need SSH "
            f"(on that machine run `bigmem-train run` directly)"
        )
    connect_kwargs: dict[str, Any] = {}
    if host.key_file:
        if not Path(host.key_file).is_file():
            raise BadInput(f"host {host.name}: ansible_ssh_private_key_file {host.key_file} does not exist")
        # Only the inventory's key: a key from the agent or ~/.ssh must not make a wrong setting work.
        connect_kwargs = {"key_filename": [host.key_file], "look_for_keys": False, "allow_agent": False}
    connection = fabric.Connection(
        host.address, user=host.user, port=host.port, connect_timeout=timeout, connect_kwargs=connect_kwargs
    )
    try:
        connection.open()
    except paramiko.AuthenticationException:
        key = f"key {host.key_file}" if host.key_file else "the default keys"
        raise Unreachable(
            f"{host.label}: login refused ({key} not accepted for user {connection.user})"
        ) from None
    except paramiko.BadHostKeyException:
        raise Unreachable(
            f"{host.label}: host key does not match known_hosts (the server was "
            f"reinstalled, or this is not that server)"
        ) from None
    except TimeoutError:
        raise Unreachable(f"{host.label}: unreachable (no answer within {timeout:g} s)") from None
    except paramiko.ssh_exception.NoValidConnectionsError as error:
        reason = (
            "connection refused"
            if all(
                isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == 111
                for e in error.errors.values()
            )
            else str(error)
        )
        raise Unreachable(f"{host.label}: unreachable ({reason})") from None
    except socket.gaierror as error:
        raise Unreachable(
            f"{host.label}: unreachable (cannot resolve {host.address}: {error.strerror})"
        ) from None
    except (OSError, paramiko.SSHException) as error:
        raise Unreachable(f"{host.label}: unreachable ({type(error).__name__}: {error})") from None
    try:
        yield connection
    finally:
        connection.close()


def _run(connection: Any, command: str, stream: bool = False) -> Any:
    """Run a shell command; never raises on a non-zero exit (callers look at ``.exited``)."""
    return connection.run(command, hide=not stream, warn=True, in_stream=False, pty=False)


def _put_text(connection: Any, text: str, remote_path: str) -> None:
    connection.put(io.BytesIO(text.encode()), remote=remote_path)


# --------------------------------------------------------------------------------------------------
# Jobs


def job_dir(host: RemoteHost, name: str) -> str:
    return f"{host.remote_dir}/jobs/{name}"


def check_job_name(name: str) -> str:
    if not JOB_NAME.match(name):
        raise BadInput(f"job name {name!r}: use letters, digits, '.', '_' and '-' (a container name)")
    return name


def default_job_name() -> str:
    return time.strftime("bigmem-%Y%m%d-%H%M%S")
