"""Jinja filters for the bigmem roles: memory sizes parsed by the kit's own parser.

``"900GiB" | bigmem_size_bytes`` and ``"80%" | bigmem_size_bytes(host_total)`` use
``bigmem_train.sizes.parse_size``, the same function the CLI uses (one source of truth). The kit is
imported from the repository (``../../src``) when it is not installed on the controller; that module
needs only the standard library.
"""

from __future__ import annotations

import re
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
        # iLO's GrayOut: accepted, then overridden at POST by the workload profile; as good as read-only.
        and dependency.get("Dependency", {}).get("MapToProperty") in ("ReadOnly", "GrayOut")
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


def bigmem_bios_plan(
    wanted, current, settings=None, dependencies=None, replace_pending=False, can_clear=True
):
    """What the bios role does with the BMC's BIOS: a dict of

    pending      values staged on the BMC, not yet applied (BIOS/Settings entries that differ from the
                 current ones: iDRAC lists only those, iLO lists the whole future state)
    changes      wanted values that differ from the current ones, attributes that others depend on
                 (registry Dependencies, e.g. SysProfile) first
    foreign      pending values the profile does not ask for (other values, or other attributes)
    outstanding  wanted values that the current and pending values together still lack
    conflict     foreign values are pending: the role stops unless replace_pending
    extend       the pending values are part of the wanted changes, and more are wanted (an earlier run with
                 fewer attributes): merged with the rest, the way Dell's idrac_bios module does it
    clear_first  clear the pending values (and their BIOS job) first, then stage all the changes: on a BMC
                 with a ClearPending action (``can_clear``, iDRAC: older firmware refuses a second PATCH while
                 a job is scheduled, newer appends to it); on extend, or on conflict with replace_pending
    stage        the values to PATCH now ({} when they are already pending, or on an unresolved conflict);
                 on a BMC without ClearPending that merges PATCHes (iLO), only the outstanding ones on extend
    blocked      a conflict that stops the play (no replace_pending, or nothing to clear it with)
    before/after the attributes concerned as the BMC will apply them at the next reboot, before and after
                 this run (for the per-attribute diff)
    """
    current = current or {}
    pending = bigmem_changed_items(settings or {}, current)
    first = {
        term.get("MapFromAttribute")
        for dependency in dependencies or []
        for term in dependency.get("Dependency", {}).get("MapFrom") or []
    }

    def ordered(values):
        return dict(sorted(values.items(), key=lambda item: item[0] not in first))

    changes = ordered(bigmem_changed_items(wanted, current))
    effective = {**current, **pending}
    outstanding = ordered(bigmem_changed_items(wanted, effective))
    foreign = {
        key: value for key, value in pending.items() if key not in wanted or not _same(value, wanted[key])
    }
    conflict = bool(pending) and bool(foreign)
    extend = bool(pending) and not foreign and bool(outstanding)
    clear = bool(can_clear) and (extend or (conflict and bool(replace_pending)))
    blocked = conflict and not clear
    if clear or not pending:
        stage = changes
    elif extend:
        stage = outstanding
    else:
        stage = {}
    keys = [key for key in current if key in wanted or key in pending]
    after_run = effective if blocked else {**(current if clear else effective), **stage}
    return {
        "pending": pending,
        "changes": changes,
        "foreign": foreign,
        "outstanding": outstanding,
        "conflict": conflict,
        "extend": extend,
        "clear_first": clear,
        "blocked": blocked,
        "stage": stage,
        "already_pending": bool(pending) and not conflict and not extend,
        "before": {key: effective[key] for key in keys},
        "after": {key: after_run[key] for key in keys},
    }


_CPU_FAMILIES = (
    ("amd", re.compile(r"\bAMD\b|EPYC", re.IGNORECASE)),
    ("intel", re.compile(r"Intel|Xeon", re.IGNORECASE)),
)
_VENDORS = (
    ("dell", re.compile(r"\bDell\b", re.IGNORECASE)),
    ("hpe", re.compile(r"\bHPE?\b|Hewlett", re.IGNORECASE)),
)


def _family(text, families):
    return next((name for name, pattern in families if pattern.search(str(text or ""))), "")


def bigmem_bios_pick_profile(profiles, vendor, system=None, attribute_names=None, requested=""):
    """The entry of ``profiles`` (bigmem_bios_profiles) for this system, as a dict of

    name    the profile's key ('' when none fits)
    reason  why it was picked, for the play's output
    error   '' or what is wrong (a bmc_vendor the system contradicts, no profile that fits)
    cpu     the CPU family the system reports (amd, intel or '')

    In this order: ``requested`` (bigmem_bios_profile); ``vendor`` (bmc_vendor) when it is a profile's key
    itself (generic, or an inventory's own); ``<vendor>_<cpu>`` with the CPU family from the Redfish system's
    ``ProcessorSummary.Model``; else the one ``<vendor>_*`` profile whose attributes the BIOS all offers
    (``attribute_names``: the BIOS attributes, or the registry's).
    """
    profiles = profiles or {}
    system = system or {}
    names = set(attribute_names or [])
    model = (system.get("ProcessorSummary") or {}).get("Model") or ""
    cpu = _family(model, _CPU_FAMILIES)
    reported = _family(system.get("Manufacturer"), _VENDORS)

    def result(name, reason, error=""):
        return {"name": name, "reason": reason, "error": error, "cpu": cpu}

    if requested:
        if requested not in profiles:
            return result(
                "",
                "",
                f"bigmem_bios_profile={requested} is not a key of bigmem_bios_profiles ({', '.join(sorted(profiles))})",
            )
        return result(requested, f"bigmem_bios_profile={requested}")
    if vendor in profiles:
        return result(vendor, f"bmc_vendor={vendor}")
    if reported and reported != vendor:
        return result(
            "",
            "",
            f"bmc_vendor={vendor}, but the system reports Manufacturer={system.get('Manufacturer')}: "
            f"set bmc_vendor={reported} on its line in inventory.ini",
        )
    if cpu and f"{vendor}_{cpu}" in profiles:
        return result(f"{vendor}_{cpu}", f"bmc_vendor={vendor} and ProcessorSummary.Model={model}")
    candidates = sorted(name for name in profiles if name.startswith(f"{vendor}_"))
    fitting = [name for name in candidates if names and set(profiles[name] or {}) <= names]
    if len(fitting) == 1:
        return result(
            fitting[0],
            f"bmc_vendor={vendor}, and {fitting[0]} is the one {vendor} profile whose attributes the BIOS all offers"
            + (f" (the system reports no CPU model{': ' + model if model else ''})" if not cpu else ""),
        )
    return result(
        "",
        "",
        f"cannot tell which profile of {', '.join(candidates) or 'none'} fits (bmc_vendor={vendor}, "
        f"ProcessorSummary.Model={model or 'not reported'}, profiles whose attributes the BIOS all offers: "
        f"{', '.join(fitting) or 'none'}): set bigmem_bios_profile",
    )


def bigmem_bios_unknown(wanted, current, profile_name, profile, overrides, profiles):
    """For the BIOS attributes of ``wanted`` the BMC does not offer (not in ``current``): one line naming each
    with where it came from (the profile, or bigmem_bios_attributes), then what to set instead: the other
    profiles whose attributes the BIOS all offers, with what they set that this one does not. '' when none."""
    current = current or {}
    unknown = [key for key in wanted or {} if key not in current]
    if not unknown:
        return ""
    overrides = overrides or {}

    def source(key):
        return "bigmem_bios_attributes" if key in overrides else f"profile {profile_name}"

    text = "does not offer " + ", ".join(f"{key} (from {source(key)})" for key in unknown) + "."
    fitting = [
        name
        for name, values in sorted((profiles or {}).items())
        if name != profile_name and values and set(values) <= set(current)
    ]
    if fitting:
        text += (
            " Set instead: "
            + "; ".join(
                f"bigmem_bios_profile={name}, which sets "
                + ", ".join(
                    f"{key}={value}" for key, value in profiles[name].items() if key not in (profile or {})
                )
                for name in fitting
            )
            + "."
        )
    return text


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
            "bigmem_bios_pick_profile": bigmem_bios_pick_profile,
            "bigmem_bios_unknown": bigmem_bios_unknown,
            "bigmem_member_uris": bigmem_member_uris,
            "bigmem_reduced_memory_modes": bigmem_reduced_memory_modes,
        }
