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
    from bigmem_train import sizes
    from bigmem_train.ops import template_names
    from bigmem_train.verdict import postmortem
except ImportError:  # the controller runs from a checkout without the kit installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from bigmem_train import sizes
    from bigmem_train.ops import template_names
    from bigmem_train.verdict import postmortem

from ansible.errors import AnsibleFilterError


def bigmem_size_bytes(text, host_total_bytes=None):
    """Bytes of a size such as ``64GiB``, ``1TB``, ``900 GB`` or ``80%`` (of ``host_total_bytes``)."""
    try:
        return sizes.parse_size(text, None if host_total_bytes is None else int(host_total_bytes))
    except sizes.BadInput as error:
        raise AnsibleFilterError(str(error)) from None


def bigmem_run_ending(run_dir, oom_killed=None, exit_code=None):
    """How a fetched run directory's job ended when it left no verdict, in the kit's words
    (``bigmem_train.verdict.postmortem``): "killed by the out-of-memory killer at about X GiB (planned Y GiB)" when
    the container's OOMKilled flag (or the OOM counters recorded in state.json) says so."""
    return postmortem.describe_fetched(
        Path(str(run_dir)),
        None if oom_killed is None else bool(oom_killed),
        None if exit_code in (None, "") else int(exit_code),
    )


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


def bigmem_member_uris(collection):
    """The ``@odata.id`` of each member of a Redfish collection (``map(attribute=...)`` reads the dot as a path)."""
    return [
        member.get("@odata.id")
        for member in (collection or {}).get("Members") or []
        if member.get("@odata.id")
    ]


def bigmem_reduced_memory_modes(current, modes, mirroring="None"):
    """``Attribute=Value`` for each BIOS attribute in ``current`` set to a mode of ``modes`` (attribute -> the
    values that leave the OS less than the installed memory), plus the BMC's ``MemorySummary.MemoryMirroring``
    when it is not None."""
    found = [
        f"{key}={current[key]}"
        for key, values in (modes or {}).items()
        if key in (current or {}) and any(_same(current[key], value) for value in values or [])
    ]
    if mirroring not in (None, "", "None"):
        found.append(f"MemorySummary.MemoryMirroring={mirroring}")
    return found


def _holds(terms, values):
    """Whether a registry dependency's MapFrom terms hold for ``values`` (attribute -> value)."""
    result = None
    for term in terms or []:
        value, target = values.get(term.get("MapFromAttribute")), term.get("MapFromValue")
        condition = term.get("MapFromCondition", "EQU")
        if condition in ("EQU", "NEQ"):
            holds = _same(value, target) == (condition == "EQU")
        else:  # GTR, GEQ, LSS, LEQ on numbers
            try:
                number, limit = float(value), float(target)
            except (TypeError, ValueError):
                holds = False
            else:
                holds = {
                    "GTR": number > limit,
                    "GEQ": number >= limit,
                    "LSS": number < limit,
                    "LEQ": number <= limit,
                }.get(condition, False)
        if result is None:
            result = holds
        elif term.get("MapTerms", "AND") == "OR":
            result = result or holds
        else:
            result = result and holds
    return bool(result)


def _read_only_rules(name, dependencies):
    return [
        dependency.get("Dependency", {})
        for dependency in dependencies or []
        if dependency.get("Type", "Map") == "Map"
        and dependency.get("Dependency", {}).get("MapToAttribute") == name
        and dependency.get("Dependency", {}).get("MapToProperty") == "ReadOnly"
    ]


def _describe(rule):
    return " and ".join(
        f"{term.get('MapFromAttribute')} {term.get('MapFromCondition', 'EQU')} {term.get('MapFromValue')}"
        for term in rule.get("MapFrom") or []
    )


def bigmem_registry_errors(wanted, registry, dependencies=None, current=None):
    """Problems of ``wanted`` BIOS attributes against a Redfish attribute registry's ``Attributes`` list.

    One line per problem: an attribute to change that is read-only, and enumeration values the registry
    does not list. Where the registry's ``Dependencies`` make an attribute read-only (Dell: ProcCStates
    unless SysProfile is Custom), the rule is evaluated for the values the BIOS will hold once ``wanted``
    is applied on top of ``current``: a dependency the same profile changes is not a problem (the role
    stages it first, in the same request). The registry's own ``ReadOnly`` flag, which reflects the
    current values, counts only for attributes without such a rule.
    """
    entries = {entry.get("AttributeName"): entry for entry in registry or []}
    current = current or {}
    after = {**current, **wanted}
    errors = []
    for key, value in wanted.items():
        entry = entries.get(key)
        if entry is None:
            continue
        if key not in current or not _same(value, current[key]):
            rules = _read_only_rules(key, dependencies)
            if rules:
                locked = [
                    rule for rule in rules if rule.get("MapToValue") and _holds(rule.get("MapFrom"), after)
                ]
                if locked:
                    errors.append(
                        f"{key} is read-only while {_describe(locked[0])}: set that in the profile too"
                    )
            elif entry.get("ReadOnly") or entry.get("Immutable"):
                errors.append(f"{key} is read-only on this BMC")
        allowed = [choice.get("ValueName") for choice in entry.get("Value") or []]
        if entry.get("Type") == "Enumeration" and allowed and not any(_same(value, name) for name in allowed):
            errors.append(f"{key}={value} is not one of {', '.join(map(str, allowed))}")
    return errors


def bigmem_bios_plan(wanted, current, settings=None, dependencies=None, replace_pending=False):
    """What the bios role does with the BMC's BIOS: a dict of

    pending      values staged on the BMC, not yet applied (BIOS/Settings entries that differ from the
                 current ones: iDRAC lists only those, iLO lists the whole future state)
    changes      wanted values that differ from the current ones, attributes that others depend on
                 (registry Dependencies, e.g. SysProfile) first
    foreign      pending values the profile does not ask for (other values, or other attributes)
    outstanding  wanted values that the current and pending values together still lack
    conflict     values are pending and they are not exactly the wanted changes: iDRAC refuses another
                 PATCH until they are applied or cleared
    clear_first  clear the pending values first (conflict and replace_pending)
    stage        the values to PATCH now ({} when they are already pending, or on an unresolved conflict)
    before/after the attributes concerned as the BMC will apply them at the next reboot, before and after
                 this run (for the per-attribute diff)
    """
    current = current or {}
    pending = bigmem_changed_items(settings or {}, current)
    changes = bigmem_changed_items(wanted, current)
    first = {
        term.get("MapFromAttribute")
        for dependency in dependencies or []
        for term in dependency.get("Dependency", {}).get("MapFrom") or []
    }
    changes = dict(sorted(changes.items(), key=lambda item: item[0] not in first))
    effective = {**current, **pending}
    outstanding = bigmem_changed_items(wanted, effective)
    foreign = {
        key: value for key, value in pending.items() if key not in wanted or not _same(value, wanted[key])
    }
    conflict = bool(pending) and bool(foreign or outstanding)
    clear = conflict and bool(replace_pending)
    stage = changes if (not pending or clear) else {}
    keys = [key for key in current if key in wanted or key in pending]
    after_run = {**current, **pending} if (pending and not clear) else {**current, **stage}
    return {
        "pending": pending,
        "changes": changes,
        "foreign": foreign,
        "outstanding": outstanding,
        "conflict": conflict,
        "clear_first": clear,
        "stage": stage,
        "already_pending": bool(pending) and not conflict,
        "before": {key: effective[key] for key in keys},
        "after": {key: after_run[key] for key in keys}
        if not (conflict and not clear)
        else {key: effective[key] for key in keys},
    }


def bigmem_job_variable_errors(job, templates_dir):
    """'' when every key of ``job`` (bigmem_train_job) is a variable templates/train.yaml.j2 or runtime.env.j2
    reads; else one line naming the others, with the closest names (a typo would be ignored otherwise)."""
    try:
        known = template_names.template_names(Path(templates_dir), template_names.JOB_TEMPLATES)
        template_names.check_variable_names(
            job or {}, known, "bigmem_train_job", template_names.JOB_TEMPLATES
        )
    except template_names.BadInput as error:
        return str(error)
    except OSError as error:
        raise AnsibleFilterError(f"templates in {templates_dir}: {error}") from None
    return ""


class FilterModule:
    """bigmem filters."""

    def filters(self):
        return {
            "bigmem_job_variable_errors": bigmem_job_variable_errors,
            "bigmem_size_bytes": bigmem_size_bytes,
            "bigmem_gib": bigmem_gib,
            "bigmem_run_ending": bigmem_run_ending,
            "bigmem_sysfs_value": bigmem_sysfs_value,
            "bigmem_changed_items": bigmem_changed_items,
            "bigmem_registry_errors": bigmem_registry_errors,
            "bigmem_bios_plan": bigmem_bios_plan,
            "bigmem_member_uris": bigmem_member_uris,
            "bigmem_reduced_memory_modes": bigmem_reduced_memory_modes,
        }
