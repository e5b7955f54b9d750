"""The Jinja filters of the Ansible roles (ansible/filter_plugins/bigmem.py)."""

import importlib.util
import tomllib
from pathlib import Path

import pytest

# Ansible is required, not skipped: scripts/setup.sh --test installs it (the ops extra). Not
# pytest.importorskip("ansible"): run from the repository root, the repository's own ansible/ folder imports
# as a namespace package of that name, so that check passed without Ansible. ansible.release is the real
# package's own module.
try:
    from ansible.release import __version__ as ansible_core_version
except ImportError as error:
    raise ImportError(
        "the Ansible filter tests need Ansible installed: bash scripts/setup.sh --test"
    ) from error

PLUGIN = Path(__file__).resolve().parents[2] / "ansible" / "filter_plugins" / "bigmem.py"
spec = importlib.util.spec_from_file_location("bigmem_filters", PLUGIN)
filters = importlib.util.module_from_spec(spec)
spec.loader.exec_module(filters)


def test_ansible_is_the_pinned_release():
    pyproject = tomllib.loads((PLUGIN.parents[2] / "pyproject.toml").read_text())
    assert f"ansible-core=={ansible_core_version}" in pyproject["project"]["optional-dependencies"]["ops"]


def test_sizes_use_the_kits_parser():
    assert filters.bigmem_size_bytes("64GiB") == 64 * 2**30
    assert filters.bigmem_size_bytes("80%", 1000) == 800
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match="not a size"):
        filters.bigmem_size_bytes("lots")


def test_changed_items_compare_typed_and_string_values():
    current = {"SysProfile": "PerfPerWattOptimizedDapc", "NumCores": 10, "LogicalProc": "Enabled"}
    wanted = {"SysProfile": "Custom", "NumCores": "10", "LogicalProc": "Enabled", "Missing": "x"}
    assert filters.bigmem_changed_items(wanted, current) == {"SysProfile": "Custom"}


def test_registry_errors_name_read_only_and_unknown_values():
    registry = [
        {
            "AttributeName": "SysProfile",
            "Type": "Enumeration",
            "ReadOnly": False,
            "Value": [{"ValueName": "PerfOptimized"}, {"ValueName": "Custom"}],
        },
        {"AttributeName": "SerialNumber", "Type": "String", "ReadOnly": True},
    ]
    assert filters.bigmem_registry_errors({"SysProfile": "Custom"}, registry) == []
    errors = filters.bigmem_registry_errors({"SysProfile": "Fast", "SerialNumber": "x", "Other": 1}, registry)
    assert errors == [
        "SysProfile=Fast is not one of PerfOptimized, Custom",
        "SerialNumber is read-only on this BMC",
    ]
    # An unchanged read-only value is not written, so not a problem.
    assert filters.bigmem_registry_errors({"SerialNumber": "x"}, registry, [], {"SerialNumber": "x"}) == []


# Dell's rule, as iDRAC's registry states it: ProcCStates is read-only while SysProfile is not Custom.
DEPENDENCIES = [
    {
        "DependencyFor": "ProcCStates",
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
            "MapToAttribute": "ProcCStates",
            "MapToProperty": "ReadOnly",
            "MapToValue": True,
        },
    }
]
REGISTRY = [
    {
        "AttributeName": "ProcCStates",
        "Type": "Enumeration",
        "ReadOnly": True,  # follows the current values
        "Value": [{"ValueName": "Enabled"}, {"ValueName": "Disabled"}],
    },
    {
        "AttributeName": "SysProfile",
        "Type": "Enumeration",
        "ReadOnly": False,
        "Value": [{"ValueName": "PerfPerWattOptimizedDapc"}, {"ValueName": "Custom"}],
    },
]
CURRENT = {"SysProfile": "PerfPerWattOptimizedDapc", "ProcCStates": "Enabled", "BootMode": "Bios"}


def test_a_dependency_the_profile_changes_too_is_not_a_problem():
    wanted = {"ProcCStates": "Disabled", "SysProfile": "Custom"}
    assert filters.bigmem_registry_errors(wanted, REGISTRY, DEPENDENCIES, CURRENT) == []
    errors = filters.bigmem_registry_errors({"ProcCStates": "Disabled"}, REGISTRY, DEPENDENCIES, CURRENT)
    assert errors == ["ProcCStates is read-only while SysProfile NEQ Custom: set that in the profile too"]
    # Without dependencies in the registry its ReadOnly flag counts (the old behaviour).
    assert filters.bigmem_registry_errors(wanted, REGISTRY, [], CURRENT) == [
        "ProcCStates is read-only on this BMC"
    ]


def test_plan_stages_the_dependency_first():
    plan = filters.bigmem_bios_plan(
        {"ProcCStates": "Disabled", "SysProfile": "Custom"}, CURRENT, {}, DEPENDENCIES
    )
    assert list(plan["stage"]) == ["SysProfile", "ProcCStates"]
    assert not plan["conflict"] and not plan["already_pending"]
    assert plan["before"] == {"SysProfile": "PerfPerWattOptimizedDapc", "ProcCStates": "Enabled"}
    assert plan["after"] == {"SysProfile": "Custom", "ProcCStates": "Disabled"}


def test_plan_with_the_profile_already_pending_stages_nothing():
    wanted = {"ProcCStates": "Disabled", "SysProfile": "Custom"}
    # iDRAC lists only the pending values at BIOS/Settings; iLO lists the whole future state.
    for settings in (wanted, {**CURRENT, **wanted}):
        plan = filters.bigmem_bios_plan(wanted, CURRENT, settings, DEPENDENCIES)
        assert plan["pending"] == wanted and plan["already_pending"] and plan["stage"] == {}
        assert plan["before"] == plan["after"]  # nothing left to change: no diff, no change counted
    # The settings object of a BMC that applies at once mirrors the current values: nothing pending.
    plan = filters.bigmem_bios_plan(wanted, CURRENT, CURRENT, DEPENDENCIES)
    assert plan["pending"] == {} and list(plan["stage"]) == ["SysProfile", "ProcCStates"]


def test_plan_with_other_values_pending_stops_unless_replacing():
    wanted = {"ProcCStates": "Disabled", "SysProfile": "Custom"}
    for can_clear in (True, False):
        plan = filters.bigmem_bios_plan(wanted, CURRENT, {"BootMode": "Uefi"}, DEPENDENCIES, False, can_clear)
        assert plan["conflict"] and plan["blocked"] and not plan["clear_first"] and plan["stage"] == {}
        assert plan["before"] == plan["after"]
    plan = filters.bigmem_bios_plan(wanted, CURRENT, {"BootMode": "Uefi"}, DEPENDENCIES, True)
    assert plan["foreign"] == {"BootMode": "Uefi"} and plan["clear_first"] and not plan["blocked"]
    assert list(plan["stage"]) == ["SysProfile", "ProcCStates"]
    assert plan["before"]["BootMode"] == "Uefi" and plan["after"]["BootMode"] == "Bios"  # cleared
    # Nothing to clear them with (iLO): replacing cannot be done, the play stops.
    plan = filters.bigmem_bios_plan(wanted, CURRENT, {"BootMode": "Uefi"}, DEPENDENCIES, True, False)
    assert plan["blocked"] and plan["stage"] == {}


def test_plan_with_part_of_the_profile_pending_stages_it_whole():
    """An earlier run staged part of the profile: with ClearPending (iDRAC), clear and stage all the changes (Dell's
    idrac_bios module merges pending and new values, deletes the job, patches again); without (iLO merges PATCHes),
    stage the rest."""
    wanted = {"ProcCStates": "Disabled", "SysProfile": "Custom"}
    plan = filters.bigmem_bios_plan(wanted, CURRENT, {"SysProfile": "Custom"}, DEPENDENCIES)
    assert plan["extend"] and plan["clear_first"] and not plan["conflict"] and not plan["already_pending"]
    assert list(plan["stage"]) == ["SysProfile", "ProcCStates"]
    assert plan["after"] == {"SysProfile": "Custom", "ProcCStates": "Disabled"}
    plan = filters.bigmem_bios_plan(
        wanted, CURRENT, {**CURRENT, "SysProfile": "Custom"}, DEPENDENCIES, False, False
    )
    assert plan["extend"] and not plan["clear_first"] and plan["stage"] == {"ProcCStates": "Disabled"}
    assert plan["before"]["SysProfile"] == "Custom" and plan["after"]["ProcCStates"] == "Disabled"


PROFILES = {
    "dell_intel": {"SysProfile": "Custom", "SubNumaCluster": "Disabled"},
    "dell_amd": {"SysProfile": "Custom", "NumaNodesPerSocket": "1"},
    "hpe_intel": {"ProcTurbo": "Enabled"},
    "hpe_amd": {"ProcAMDBoost": "Enabled"},
    "generic": {},
}


@pytest.mark.parametrize(
    "vendor, system, names, requested, picked",
    [
        ("dell", {"ProcessorSummary": {"Model": "AMD EPYC 9654 96-Core Processor"}}, [], "", "dell_amd"),
        ("dell", {"ProcessorSummary": {"Model": "Intel(R) Xeon(R) Gold 6338"}}, [], "", "dell_intel"),
        ("hpe", {"Manufacturer": "HPE", "ProcessorSummary": {"Model": "AMD EPYC 9554"}}, [], "", "hpe_amd"),
        # No CPU model: the one profile of the vendor whose attributes the BIOS all offers.
        ("dell", {}, ["SysProfile", "NumaNodesPerSocket", "BootMode"], "", "dell_amd"),
        ("hpe", {"ProcessorSummary": {}}, ["ProcTurbo"], "", "hpe_intel"),
        # Named: bigmem_bios_profile wins over the system; bmc_vendor that is a profile's key is one.
        ("dell", {"ProcessorSummary": {"Model": "AMD EPYC"}}, [], "dell_intel", "dell_intel"),
        ("generic", {"Manufacturer": "Dell Inc."}, [], "", "generic"),
    ],
)
def test_pick_profile(vendor, system, names, requested, picked):
    pick = filters.bigmem_bios_pick_profile(PROFILES, vendor, system, names, requested)
    assert pick["name"] == picked and pick["error"] == "", pick


def test_pick_profile_errors():
    pick = filters.bigmem_bios_pick_profile(PROFILES, "dell", {"Manufacturer": "HPE"}, [], "")
    assert pick["name"] == "" and "set bmc_vendor=hpe" in pick["error"]
    pick = filters.bigmem_bios_pick_profile(PROFILES, "dell", {}, ["SysProfile"], "")
    assert pick["name"] == "" and "set bigmem_bios_profile" in pick["error"]
    pick = filters.bigmem_bios_pick_profile(PROFILES, "dell", {}, [], "dell_arm")
    assert "dell_arm is not a key" in pick["error"]


def test_unknown_names_the_source_and_what_to_set_instead():
    current = {"SysProfile": "Custom", "NumaNodesPerSocket": "4"}
    wanted = {**PROFILES["dell_intel"], "Foo": "1"}
    text = filters.bigmem_bios_unknown(
        wanted, current, "dell_intel", PROFILES["dell_intel"], {"Foo": "1"}, PROFILES
    )
    assert "SubNumaCluster (from profile dell_intel), Foo (from bigmem_bios_attributes)" in text
    assert "bigmem_bios_profile=dell_amd, which sets NumaNodesPerSocket=1" in text
    assert filters.bigmem_bios_unknown(PROFILES["dell_amd"], current, "dell_amd", {}, {}, PROFILES) == ""


def test_member_uris():
    assert filters.bigmem_member_uris({"Members": [{"@odata.id": "/redfish/v1/Systems/1"}, {}]}) == [
        "/redfish/v1/Systems/1"
    ]


@pytest.mark.parametrize(
    "text, value",
    [
        ("always [madvise] never\n", "madvise"),
        ("performance\n", "performance"),
        ("0\n", "0"),
        ("[always] defer defer+madvise madvise never", "always"),
    ],
)
def test_sysfs_value(text, value):
    assert filters.bigmem_sysfs_value(text) == value


def test_reduced_memory_modes():
    modes = {"MemOpMode": ["MirrorMode", "SpareMode"], "AdvancedMemProtection": ["MirroredAdvancedEcc"]}
    assert filters.bigmem_reduced_memory_modes({"MemOpMode": "OptimizerMode"}, modes) == []
    assert filters.bigmem_reduced_memory_modes({"MemOpMode": "MirrorMode"}, modes) == ["MemOpMode=MirrorMode"]
    assert filters.bigmem_reduced_memory_modes({}, modes, "System") == [
        "MemorySummary.MemoryMirroring=System"
    ]


def test_job_variables_no_template_reads_are_named():
    templates = Path(__file__).resolve().parents[2] / "templates"
    assert filters.bigmem_job_variable_errors({}, str(templates)) == ""
    assert filters.bigmem_job_variable_errors({"batch_size": 4, "tf_log_level": 1}, str(templates)) == ""
    message = filters.bigmem_job_variable_errors({"batchsize": 16}, str(templates))
    assert message.startswith("bigmem_train_job: 'batchsize' (did you mean 'batch_size'?) is not read by")
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match="templates in"):
        filters.bigmem_job_variable_errors({"epochs": 1}, str(templates / "missing"))
