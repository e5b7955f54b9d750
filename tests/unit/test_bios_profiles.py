"""The BIOS profiles' goal values (roles/bigmem_bios), pinned against a table written by hand, and checked
against the registries the lab's Redfish emulator serves (tests/lab/bmc.py) and against the role's pick.

The other BIOS tests read the goals from the role's own defaults, so a legal but wrong value (SMT off on an
AMD profile, two NUMA domains per socket) passed them. Here every attribute of every profile is written out:
changing one goal to another value the BIOS accepts fails ``test_every_profile_sets_exactly_its_goals``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
ROLE = REPO_ROOT / "ansible" / "roles" / "bigmem_bios"
LAB = REPO_ROOT / "tests" / "lab"

# The goals, the same for every vendor and CPU family: all cores and SMT on, turbo on, no deep C-states,
# full memory speed, one NUMA domain per socket (no sub-NUMA clustering, no interleaving across sockets),
# all memory usable (no mirroring, no sparing). The system or workload profile is Custom, since the preset
# ones govern the processor settings and would put their own values back.
GOALS: dict[str, dict[str, str]] = {
    # Dell iDRAC 9, Intel Xeon. Names and values: the iDRAC 9 BIOS attribute registry (racadm groups
    # BIOS.SysProfileSettings, BIOS.ProcSettings, BIOS.MemSettings); the settings as Dell's "BIOS Settings for
    # Optimized Performance on Next-Generation Dell PowerEdge Servers" (infohub.delltechnologies.com, 2023)
    # recommends them for low latency and memory bandwidth: System Profile Custom, CPU Power Management
    # Maximum Performance, C States and C1E Disabled, Turbo Boost Enabled, Memory Frequency Maximum Performance.
    "dell_intel": {
        "SysProfile": "Custom",
        "ProcPwrPerf": "MaxPerf",
        "ProcCStates": "Disabled",
        "ProcC1E": "Disabled",
        "ProcTurboMode": "Enabled",
        "LogicalProc": "Enabled",
        "SubNumaCluster": "Disabled",
        "NodeInterleave": "Disabled",
        "MemFrequency": "MaxPerf",
        "MemOpMode": "OptimizerMode",
    },
    # Dell iDRAC 9, AMD EPYC: the same system profile attributes, no ProcC1E/SubNumaCluster/NodeInterleave;
    # NUMA per socket is NumaNodesPerSocket ("0", "1", "2", "4": Dell's "NUMA Configuration settings on AMD
    # EPYC 2nd Generation", infohub.delltechnologies.com, and the PowerEdge R7515 manual's "NUMA nodes per
    # socket"): "1" is NPS1, one NUMA domain per socket. The value is a string in the registry.
    "dell_amd": {
        "SysProfile": "Custom",
        "ProcPwrPerf": "MaxPerf",
        "ProcCStates": "Disabled",
        "ProcTurboMode": "Enabled",
        "LogicalProc": "Enabled",
        "NumaNodesPerSocket": "1",
        "MemFrequency": "MaxPerf",
    },
    # HPE iLO 5/6, Intel Xeon. Names and values: HPE's "Bios resource definitions of iLO 5 v2.81" and "of iLO 6
    # v1.66" (servermanagementportal.ext.hpe.com/docs/redfishservices/ilos/): WorkloadProfile (Custom),
    # PowerRegulator (StaticHighPerf), MinProcIdlePower (NoCStates), ProcTurbo, ProcHyperthreading,
    # SubNumaClustering, NodeInterleaving, EnergyPerfBias (MaxPerf), AdvancedMemProtection (AdvancedEcc: no
    # mirroring or online spare).
    "hpe_intel": {
        "WorkloadProfile": "Custom",
        "PowerRegulator": "StaticHighPerf",
        "MinProcIdlePower": "NoCStates",
        "ProcTurbo": "Enabled",
        "ProcHyperthreading": "Enabled",
        "SubNumaClustering": "Disabled",
        "NodeInterleaving": "Disabled",
        "EnergyPerfBias": "MaxPerf",
        "AdvancedMemProtection": "AdvancedEcc",
    },
    # HPE iLO 5/6, AMD EPYC (the same iLO BIOS resource definitions, AMD ProLiant): ProcAMDBoost and ProcSMT
    # instead of ProcTurbo and ProcHyperthreading; NumaMemoryDomainsPerSocket OneMemoryDomainPerSocket (NPS1);
    # AmdMemoryInterleaving Auto (channels interleaved within the domain; Disabled costs bandwidth).
    "hpe_amd": {
        "WorkloadProfile": "Custom",
        "PowerRegulator": "StaticHighPerf",
        "MinProcIdlePower": "NoCStates",
        "ProcAMDBoost": "Enabled",
        "ProcSMT": "Enabled",
        "NumaMemoryDomainsPerSocket": "OneMemoryDomainPerSocket",
        "AmdMemoryInterleaving": "Auto",
    },
    # Any other BMC: only bigmem_bios_attributes apply.
    "generic": {},
}

# The lab emulator's flavour of each vendor x CPU profile, and the inventory's bmc_vendor for it.
FLAVOURS = {
    "dell_intel": ("dell-intel", "dell"),
    "dell_amd": ("dell-amd", "dell"),
    "hpe_intel": ("hpe-intel", "hpe"),
    "hpe_amd": ("hpe-amd", "hpe"),
}
VENDOR_PROFILES = sorted(FLAVOURS)


def role_profiles() -> dict:
    """bigmem_bios_profiles as a play sees it: group_vars/all/ when one of its files sets it, else the role's
    defaults."""
    profiles = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())["bigmem_bios_profiles"]
    for path in sorted((REPO_ROOT / "ansible" / "group_vars" / "all").glob("*.yml")):
        values = yaml.safe_load(path.read_text()) or {}
        profiles = values.get("bigmem_bios_profiles", profiles)
    return profiles


def lab_emulator():
    """tests/lab/bmc.py's registry code (FLAVOURS, registry, refuse_patch), without sushy-tools, flask and
    libvirt: those are imported only by the lab's own venv, and only the serving parts use them."""
    source = (LAB / "bmc.py").read_text()
    tree = ast.parse(source)
    served_only = {"bcrypt", "flask", "libvirt", "sushy_tools"}

    def needed(node: ast.stmt) -> bool:
        if isinstance(node, ast.Import):
            return not any(alias.name.split(".")[0] in served_only for alias in node.names)
        if isinstance(node, ast.ImportFrom):
            return (node.module or "").split(".")[0] not in served_only
        return True

    tree.body = [node for node in tree.body if needed(node)]
    module = types.ModuleType("lab_bmc_registry")
    sys.modules[module.__name__] = module  # dataclasses look their class's module up while making it
    try:
        exec(compile(tree, str(LAB / "bmc.py"), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


def role_filters():
    """The roles' Jinja filters (ansible/filter_plugins/bigmem.py), bigmem_bios_pick_profile among them."""
    plugin = REPO_ROOT / "ansible" / "filter_plugins" / "bigmem.py"
    spec = importlib.util.spec_from_file_location("bigmem_filters", plugin)
    filters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(filters)
    return filters


@pytest.fixture(scope="module")
def emulator():
    return lab_emulator()


def initial_bios(flavour: str) -> dict:
    return json.loads((LAB / "bios-initial" / f"{flavour}.json").read_text())


def test_every_profile_sets_exactly_its_goals():
    profiles = role_profiles()
    assert sorted(profiles) == sorted(GOALS)
    for name, goals in GOALS.items():
        # Exactly: the same names, and the same values of the same type (the BMC compares strings).
        role = profiles[name] or {}
        wrong = {
            attribute: {"role": role.get(attribute, "(missing)"), "goal": goals.get(attribute, "(missing)")}
            for attribute in sorted(set(role) | set(goals))
            if role.get(attribute) != goals.get(attribute) or type(role.get(attribute)) is not str
        }
        assert not wrong, f"profile {name} differs from its goals: {wrong}"


@pytest.mark.parametrize("profile", VENDOR_PROFILES)
def test_the_emulator_registry_offers_every_goal(emulator, profile):
    flavour_name, _ = FLAVOURS[profile]
    flavour = emulator["FLAVOURS"][flavour_name]
    initial = initial_bios(flavour_name)
    served = emulator["registry"](flavour, initial)
    entries = {entry["AttributeName"]: entry for entry in served["RegistryEntries"]["Attributes"]}
    for name, value in GOALS[profile].items():
        assert name in entries, f"{flavour_name}'s registry has no {name}"
        entry = entries[name]
        assert entry["Type"] == "Enumeration" and not entry["Immutable"], entry
        legal = [option["ValueName"] for option in entry["Value"]]
        assert value in legal, f"{flavour_name}: {name}={value} is not one of {legal}"
        # The goal is a choice among several, so a test that pins it can tell a wrong one.
        assert len(legal) >= 2, entry
    # The emulator, as iDRAC or iLO, takes the whole profile in one PATCH from its initial BIOS (the
    # governed attributes together with SysProfile/WorkloadProfile=Custom).
    assert emulator["refuse_patch"](flavour, initial, {}, dict(GOALS[profile])) is None


@pytest.mark.parametrize("profile", VENDOR_PROFILES)
def test_the_role_picks_each_profile_from_what_the_system_reports(emulator, profile):
    filters = role_filters()
    flavour_name, vendor = FLAVOURS[profile]
    flavour = emulator["FLAVOURS"][flavour_name]
    profiles = role_profiles()
    system = {"Manufacturer": flavour.manufacturer, "ProcessorSummary": {"Model": flavour.processor_model}}
    pick = filters.bigmem_bios_pick_profile(profiles, vendor, system, [], "")
    assert (pick["name"], pick["error"]) == (profile, ""), pick
    # Without a CPU model: by the attribute names the BIOS offers.
    names = list(initial_bios(flavour_name))
    pick = filters.bigmem_bios_pick_profile(
        profiles, vendor, {"Manufacturer": flavour.manufacturer}, names, ""
    )
    assert (pick["name"], pick["error"]) == (profile, ""), pick
