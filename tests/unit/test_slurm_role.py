"""The bigmem_slurm role's slurm.conf and cgroup.conf: rendered from the role's own templates with the facts of
a big server (4 sockets x 28 cores x 2 threads, 1.5 TB) and of a two-node cluster, RealMemory computed by the
role's own task expression (hand-computed here); the argument specs cover the defaults; and, where Slurm is
installed, the node line Ansible renders from this machine's real facts matches what `slurmd -C` prints."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible" / "roles" / "bigmem_slurm"
BIN = Path(sys.executable).parent
MIB = 1048576


def filters() -> dict:
    """Ansible's core filters and the kit's (bigmem_size_bytes), as the role's templates see them."""
    pytest.importorskip("ansible")
    import importlib.util

    from ansible.plugins.filter.core import FilterModule as CoreFilters

    spec = importlib.util.spec_from_file_location(
        "bigmem_filters", REPO / "ansible" / "filter_plugins" / "bigmem.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return CoreFilters().filters() | module.FilterModule().filters()


def environment() -> jinja2.Environment:
    # Ansible's template module renders with trim_blocks on.
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(ROLE / "templates"),
        trim_blocks=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.filters.update(filters())
    return env


def defaults() -> dict:
    return yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())


def node_memory_mib(facts: dict, os_reserve: str) -> int:
    """The role's own expression (tasks/memory.yml) evaluated for one host."""
    tasks = yaml.safe_load((ROLE / "tasks" / "memory.yml").read_text())
    expression = tasks[0]["ansible.builtin.set_fact"]["bigmem_slurm_node_memory_mib"]
    text = (
        environment().from_string(expression).render(ansible_facts=facts, bigmem_slurm_os_reserve=os_reserve)
    )
    return int(text.strip())


def server_facts(hostname: str, address: str | None, memtotal_mb: int) -> dict:
    facts = {
        "hostname": hostname,
        "processor_vcpus": 224,
        "processor_count": 4,
        "processor_cores": 28,
        "processor_threads_per_core": 2,
        "memtotal_mb": memtotal_mb,
        "default_ipv4": {"address": address} if address else {},
    }
    return facts


def render(name: str, hosts: dict[str, dict], os_reserve: str = "4GiB", **variables) -> str:
    hostvars = {
        host: {"ansible_facts": facts, "bigmem_slurm_node_memory_mib": node_memory_mib(facts, os_reserve)}
        for host, facts in hosts.items()
    }
    context = defaults() | {"bigmem_slurm_os_reserve": os_reserve} | variables
    context["bigmem_slurm_nodes"] = variables.get("bigmem_slurm_nodes", list(hosts))
    context["bigmem_slurm_controller"] = variables.get(
        "bigmem_slurm_controller", context["bigmem_slurm_nodes"][0]
    )
    return environment().get_template(name).render(hostvars=hostvars, **context)


def lines(text: str, key: str) -> list[dict[str, str]]:
    """Every non-comment line that starts with ``key=`` as a dict of its ``Key=Value`` words."""
    found = []
    for line in text.splitlines():
        if line.startswith(f"{key}="):
            found.append(dict(word.split("=", 1) for word in line.split()))
    return found


def settings(text: str) -> dict[str, str]:
    return {
        line.split("=", 1)[0]: line.split("=", 1)[1]
        for line in text.splitlines()
        if "=" in line and not line.startswith("#") and " " not in line.split("=", 1)[0]
    }


BIG = {"bigmem-01": server_facts("bigmem-01", "192.0.2.11", memtotal_mb=1547916)}


@pytest.mark.parametrize(
    ("os_reserve", "real_memory"),
    [
        ("4GiB", 1547916 - 4096),  # 1543820
        ("4GB", 1547916 - 3815),  # 4e9 B = 3814.7 MiB, rounded up
        ("5%", 1547916 - 77396),  # 1547916 * 0.05 = 77395.8 MiB, rounded up
        ("1MiB", 1547916 - 1),
    ],
)
def test_real_memory_is_the_total_less_the_os_share(os_reserve, real_memory):
    assert node_memory_mib(BIG["bigmem-01"], os_reserve) == real_memory
    (node,) = lines(render("slurm.conf.j2", BIG, os_reserve=os_reserve), "NodeName")
    assert node["RealMemory"] == str(real_memory)


def test_a_reserve_larger_than_the_node_leaves_nothing():
    # tasks/memory.yml's assert stops the play on this (<= 0).
    small = server_facts("small", None, memtotal_mb=2000)
    assert node_memory_mib(small, "4GiB") == 2000 - 4096


def test_a_bad_reserve_is_refused_with_the_kits_message():
    with pytest.raises(Exception, match="not a size"):
        node_memory_mib(BIG["bigmem-01"], "lots")


def test_the_node_line_is_what_slurmd_c_prints_for_the_server():
    text = render("slurm.conf.j2", BIG)
    (node,) = lines(text, "NodeName")
    assert node == {
        "NodeName": "bigmem-01",
        "NodeAddr": "192.0.2.11",
        "CPUs": "224",
        "Boards": "1",
        "SocketsPerBoard": "4",
        "CoresPerSocket": "28",
        "ThreadsPerCore": "2",
        "RealMemory": "1543820",
        "State": "UNKNOWN",
    }
    # Slurm refuses a node whose CPUs are not sockets x cores x threads.
    assert int(node["SocketsPerBoard"]) * int(node["CoresPerSocket"]) * int(node["ThreadsPerCore"]) == 224


def test_the_one_partition_holds_every_node_and_is_the_default():
    hosts = {
        "server-a": server_facts("bigmem-a", "192.0.2.21", memtotal_mb=1547916),
        "server-b": server_facts("bigmem-b", "192.0.2.22", memtotal_mb=773958),
    }
    text = render("slurm.conf.j2", hosts, bigmem_slurm_max_time="2-00:00:00")
    assert [node["NodeName"] for node in lines(text, "NodeName")] == ["bigmem-a", "bigmem-b"]
    assert [node["RealMemory"] for node in lines(text, "NodeName")] == ["1543820", str(773958 - 4096)]
    (partition,) = lines(text, "PartitionName")
    assert partition == {
        "PartitionName": "bigmem",
        "Nodes": "bigmem-a,bigmem-b",
        "Default": "YES",
        "MaxTime": "2-00:00:00",
        "State": "UP",
    }
    assert settings(text)["SlurmctldHost"] == "bigmem-a(192.0.2.21)"
    other = render("slurm.conf.j2", hosts, bigmem_slurm_controller="server-b", bigmem_slurm_partition="train")
    assert settings(other)["SlurmctldHost"] == "bigmem-b(192.0.2.22)"
    assert lines(other, "PartitionName")[0]["PartitionName"] == "train"


def test_slurm_conf_confines_jobs_with_cgroups_and_counts_memory():
    conf = settings(render("slurm.conf.j2", BIG))
    assert conf["ProctrackType"] == "proctrack/cgroup"
    assert conf["TaskPlugin"] == "task/cgroup,task/affinity"
    assert conf["SelectType"] == "select/cons_tres"
    assert conf["SelectTypeParameters"] == "CR_Core_Memory"  # --mem is a consumable resource
    assert conf["AuthType"] == "auth/munge" and conf["ClusterName"] == "bigmem"


def test_cgroup_conf_enforces_memory_and_cores():
    conf = settings(render("cgroup.conf.j2", BIG))
    assert conf["ConstrainRAMSpace"] == "yes"
    assert conf["ConstrainCores"] == "yes"
    assert conf["ConstrainSwapSpace"] == "no"
    assert (
        settings(render("cgroup.conf.j2", BIG, bigmem_slurm_constrain_swap=True))["ConstrainSwapSpace"]
        == "yes"
    )


def test_every_default_has_an_argument_spec_and_the_flag_is_off():
    spec = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"][
        "options"
    ]
    assert set(spec) == set(defaults())
    assert defaults()["bigmem_slurm_enabled"] is False
    assert spec["bigmem_slurm_munge_key"].get("no_log") is True


def test_site_runs_the_role_by_its_tag_and_flag():
    plays = yaml.safe_load((REPO / "ansible" / "site.yml").read_text())
    (role,) = [play["roles"][0] for play in plays if play["roles"][0]["role"] == "bigmem_slurm"]
    assert role["tags"] == ["slurm"] and role["when"] == "bigmem_slurm_enabled | bool"


def test_the_munge_key_never_reaches_the_log():
    tasks = yaml.safe_load((ROLE / "tasks" / "munge.yml").read_text())
    for task in tasks:
        if "ansible.builtin.slurp" in task or "stdin" in str(task):
            assert task.get("no_log") is True, task["name"]


def _slurmd_c() -> dict[str, str]:
    slurmd = shutil.which("slurmd") or ("/usr/sbin/slurmd" if os.path.exists("/usr/sbin/slurmd") else None)
    if slurmd is None:
        pytest.skip("slurmd not installed (bash scripts/setup.sh --test)")
    done = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=60, check=True)
    return dict(word.split("=", 1) for word in done.stdout.splitlines()[0].split())


def test_ansible_renders_this_machines_node_line_as_slurmd_c_prints_it(tmp_path):
    """Real Ansible, real facts: the role's memory task and template on localhost, against `slurmd -C`."""
    expected = _slurmd_c()
    playbook_binary = BIN / "ansible-playbook"
    if not playbook_binary.exists():
        pytest.skip("ansible-playbook not installed")
    playbook = tmp_path / "render.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Render the slurm role's configuration on this machine",
                    "hosts": "localhost",
                    "gather_facts": True,
                    "vars": {"bigmem_slurm_os_reserve": "1GiB"},
                    "tasks": [
                        {
                            "name": "Compute RealMemory as the role does",
                            "ansible.builtin.include_role": {"name": "bigmem_slurm", "tasks_from": "memory"},
                        },
                        {
                            "name": "Render slurm.conf",
                            "ansible.builtin.template": {
                                "src": str(ROLE / "templates" / "slurm.conf.j2"),
                                "dest": str(tmp_path / "slurm.conf"),
                                "mode": "0644",
                            },
                            "vars": {
                                "bigmem_slurm_nodes": ["localhost"],
                                "bigmem_slurm_controller": "localhost",
                            }
                            | {
                                key: value
                                for key, value in defaults().items()
                                if key
                                not in (
                                    "bigmem_slurm_nodes",
                                    "bigmem_slurm_controller",
                                    "bigmem_slurm_os_reserve",
                                )
                            },
                        },
                    ],
                }
            ]
        )
    )
    env = dict(
        os.environ,
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    done = subprocess.run(
        [
            str(playbook_binary),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            "ansible_become=false",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(playbook),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    (node,) = lines((tmp_path / "slurm.conf").read_text(), "NodeName")
    for key in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore"):
        assert node[key] == expected[key], (key, node, expected)
    # A node may declare less memory than slurmd finds, never more (slurmd would drain it); 1 GiB less here.
    assert 0 < int(node["RealMemory"]) <= int(expected["RealMemory"])
    assert int(expected["RealMemory"]) - int(node["RealMemory"]) <= 1024 + 64
