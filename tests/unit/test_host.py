"""Host facts from recorded sysfs/procfs layouts: memory, cgroup v1/v2 limits, NUMA nodes, hugepages, THP."""

from pathlib import Path

import pytest

from bigmem_train.host import (
    parse_cpu_list,
    parse_meminfo,
    read_cgroup_limit,
    read_cgroup_memory,
    read_host_facts,
)

HOSTS = Path(__file__).resolve().parents[1] / "fixtures" / "hosts"
GIB = 1024**3


def facts(name: str):
    return read_host_facts(HOSTS / name)


def test_cpu_list_ranges_and_singles():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []


def test_meminfo_bytes_and_counts():
    values = parse_meminfo("MemTotal:  1024 kB\nHugePages_Total:   4\nNode 1 MemFree:  2 kB\n")
    assert values == {"MemTotal": 1024 * 1024, "HugePages_Total": 4, "MemFree": 2048}


def test_cgroup_v2_limit_in_a_container():
    host = facts("one_node_cgroup2")
    assert (host.cgroup_limit_bytes, host.cgroup_version) == (8 * GIB, 2)
    assert host.cgroup_usage_bytes == 300 * 1024**2
    # The limit caps both what is available and the total a "80%" target refers to.
    assert host.effective_memory_bytes == 8 * GIB
    assert host.limit_total_bytes == 8 * GIB


def test_cgroup_v2_limit_set_on_the_parent_slice():
    limit, version, usage = read_cgroup_memory(HOSTS / "four_node_cxl_cgroup2")
    assert (limit, version, usage) == (1536 * GIB, 2, 1 * GIB)


def test_cgroup_v1_limit_of_the_docker_cgroup():
    assert read_cgroup_limit(HOSTS / "two_node_cgroup1") == (100 * GIB, 1)


def test_cgroup_v1_hierarchical_limit_of_a_parent():
    # The job's own limit_in_bytes is "unlimited"; memory.stat's hierarchical_memory_limit is not.
    assert read_cgroup_limit(HOSTS / "two_node_pmem_cgroup1") == (120 * GIB, 1)


def test_hybrid_layout_without_limit():
    host = facts("one_node_hybrid_unlimited")
    assert (host.cgroup_limit_bytes, host.cgroup_version) == (None, 1)
    assert host.effective_memory_bytes == 21 * GIB


def test_no_cgroup_at_all(tmp_path):
    assert read_cgroup_memory(tmp_path) == (None, None, None)


@pytest.mark.parametrize(
    "name, nodes, cpus_per_node",
    [
        ("one_node_cgroup2", [0], [16]),
        ("two_node_cgroup1", [0, 1], [16, 16]),
        ("four_node_cxl_cgroup2", [0, 1, 2, 3], [32, 32, 0, 0]),
        ("two_node_pmem_cgroup1", [0, 1], [8, 0]),
    ],
)
def test_numa_nodes_and_memory_only_nodes(name, nodes, cpus_per_node):
    host = facts(name)
    assert [node.node_id for node in host.numa_nodes] == nodes
    assert [len(node.cpus) for node in host.numa_nodes] == cpus_per_node
    assert [node.has_cpus for node in host.numa_nodes] == [count > 0 for count in cpus_per_node]


def test_node_memory_available_counts_free_and_page_cache():
    node0, node1 = facts("two_node_cgroup1").numa_nodes
    assert node0.memory_total_bytes == 96 * GIB
    assert node0.memory_available_bytes == (80 + 6) * GIB
    assert node1.memory_available_bytes == (90 + 4) * GIB
    assert node0.hugepages_1g == 4 and node0.static_hugepages_bytes == 4 * GIB


def test_static_hugepages_are_taken_from_the_total():
    host = facts("two_node_pmem_cgroup1")
    assert host.static_hugepages_bytes == 2 * GIB  # 1024 x 2 MiB
    # 160 GiB less 2 GiB of hugepages, capped by the 120 GiB cgroup limit.
    assert host.limit_total_bytes == 120 * GIB
    host.cgroup_limit_bytes = None
    assert host.limit_total_bytes == 158 * GIB


def test_thp_swap_and_cpus():
    host = facts("one_node_cgroup2")
    assert host.thp_enabled == "always" and host.thp_defrag == "madvise"
    assert host.swap_total_bytes == 8 * GIB and host.swap_free_bytes == 8 * GIB
    assert host.logical_cpus == 16 and host.usable_cpus == list(range(16))
    assert "avx512f" in host.cpu_flags


def test_to_dict_reports_derived_values():
    data = facts("two_node_cgroup1").to_dict()
    assert data["static_hugepages_bytes"] == 4 * GIB
    assert data["limit_total_bytes"] == 100 * GIB


def test_this_machine_reads():
    host = read_host_facts()
    assert host.memory_total_bytes > 0 and host.logical_cpus >= 1


def test_onednn_default_follows_the_cpu_unless_the_switch_is_set(monkeypatch):
    from bigmem_train.host import onednn_enabled

    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    assert onednn_enabled(["avx2", "fma"]) is False
    assert onednn_enabled(["avx2", "avx512f", "avx512_vnni"]) is True
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    assert onednn_enabled(["avx2"]) is True
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    assert onednn_enabled(["amx_tile"]) is False
