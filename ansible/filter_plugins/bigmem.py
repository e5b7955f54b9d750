"""Jinja filters for the bigmem roles: memory sizes parsed by the kit's own parser.

``"900GiB" | bigmem_size_bytes`` and ``"80%" | bigmem_size_bytes(host_total)`` use
``bigmem_train.sizes.parse_size``, the same function the CLI uses (one source of truth). The kit is
imported from the repository (``../../src``) when it is not installed on the controller; that module
needs only the standard library.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from bigmem_train import postmortem, sizes
except ImportError:  # the controller runs from a checkout without the kit installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from bigmem_train import postmortem, sizes

from ansible.errors import AnsibleFilterError


def bigmem_size_bytes(text, host_total_bytes=None):
    """Bytes of a size such as ``64GiB``, ``1TB``, ``900 GB`` or ``80%`` (of ``host_total_bytes``)."""
    try:
        return sizes.parse_size(text, None if host_total_bytes is None else int(host_total_bytes))
    except sizes.BadInput as error:
        raise AnsibleFilterError(str(error)) from None


def bigmem_run_ending(run_dir, oom_killed=None, exit_code=None):
    """How a fetched run directory's job ended when it left no verdict, in the kit's words
    (``bigmem_train.postmortem``): "killed by the out-of-memory killer at about X GiB (planned Y GiB)" when
    the container's OOMKilled flag (or the OOM counters recorded in state.json) says so."""
    return postmortem.describe_fetched(Path(str(run_dir)), None if oom_killed is None else bool(oom_killed),
                                       None if exit_code in (None, "") else int(exit_code))


def bigmem_gib(num_bytes):
    """Bytes -> GiB rounded to 3 decimals, for messages."""
    return sizes.gib(int(num_bytes))


def bigmem_sysfs_value(text):
    """The value a sysfs file holds: the bracketed choice of ``always [madvise] never``, else the trimmed text."""
    text = str(text)
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip()


def _same(wanted, current):
    # Redfish returns typed values; inventory values may arrive as strings ("16" vs 16).
    return wanted == current or str(wanted) == str(current)


def bigmem_changed_items(wanted, current):
    """The entries of ``wanted`` whose value differs from ``current`` (keys missing there are left out)."""
    return {key: value for key, value in wanted.items() if key in current and not _same(value, current[key])}


def bigmem_registry_errors(wanted, registry):
    """Problems of ``wanted`` BIOS attributes against a Redfish attribute registry's ``Attributes`` list.

    One line per problem: read-only attributes and enumeration values the registry does not list.
    """
    entries = {entry.get("AttributeName"): entry for entry in registry or []}
    errors = []
    for key, value in wanted.items():
        entry = entries.get(key)
        if entry is None:
            continue
        if entry.get("ReadOnly"):
            errors.append(f"{key} is read-only on this BMC")
        allowed = [choice.get("ValueName") for choice in entry.get("Value") or []]
        if entry.get("Type") == "Enumeration" and allowed and not any(_same(value, name) for name in allowed):
            errors.append(f"{key}={value} is not one of {', '.join(map(str, allowed))}")
    return errors


class FilterModule:
    """bigmem filters."""

    def filters(self):
        return {
            "bigmem_size_bytes": bigmem_size_bytes,
            "bigmem_gib": bigmem_gib,
            "bigmem_run_ending": bigmem_run_ending,
            "bigmem_sysfs_value": bigmem_sysfs_value,
            "bigmem_changed_items": bigmem_changed_items,
            "bigmem_registry_errors": bigmem_registry_errors,
        }
