"""The Jinja filters of the Ansible roles (ansible/filter_plugins/bigmem.py)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("ansible")

PLUGIN = Path(__file__).resolve().parents[2] / "ansible" / "filter_plugins" / "bigmem.py"
spec = importlib.util.spec_from_file_location("bigmem_filters", PLUGIN)
filters = importlib.util.module_from_spec(spec)
spec.loader.exec_module(filters)


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
        {"AttributeName": "SysProfile", "Type": "Enumeration", "ReadOnly": False,
         "Value": [{"ValueName": "PerfOptimized"}, {"ValueName": "Custom"}]},
        {"AttributeName": "SerialNumber", "Type": "String", "ReadOnly": True},
    ]
    assert filters.bigmem_registry_errors({"SysProfile": "Custom"}, registry) == []
    errors = filters.bigmem_registry_errors({"SysProfile": "Fast", "SerialNumber": "x", "Other": 1}, registry)
    assert errors == ["SysProfile=Fast is not one of PerfOptimized, Custom", "SerialNumber is read-only on this BMC"]


@pytest.mark.parametrize("text, value", [("always [madvise] never\n", "madvise"), ("performance\n", "performance"),
                                         ("0\n", "0"), ("[always] defer defer+madvise madvise never", "always")])
def test_sysfs_value(text, value):
    assert filters.bigmem_sysfs_value(text) == value
