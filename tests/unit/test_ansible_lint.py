"""The Ansible content passes ansible-lint (production profile), yamllint and a syntax check; the
inventory parses; the collections are the pinned ones; every role default is documented in group_vars."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} not installed (bash scripts/setup.sh --test)")
    return str(path)


def run(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", NO_COLOR="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    return subprocess.run(argv, cwd=ANSIBLE_DIR, capture_output=True, text=True, timeout=timeout, env=env)


def test_ansible_lint_production_profile():
    result = run(tool("ansible-lint"), "--profile", "production", "--offline", "--nocolor")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


def test_yamllint():
    result = run(tool("yamllint"), "--strict", "-c", ".yamllint", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_site_syntax_check_from_the_ansible_folder():
    # The README's command runs from ansible/, where ansible.cfg points at ../inventory.ini.
    result = run(tool("ansible-playbook"), "site.yml", "--syntax-check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr


def test_inventory_has_the_lab_group_and_the_demo_host():
    result = run(tool("ansible-inventory"), "--list")
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr and "DEPRECATION" not in result.stderr, result.stderr
    inventory = json.loads(result.stdout)
    hostvars = inventory["_meta"]["hostvars"]
    servers = inventory["bigmem"]["hosts"]
    assert servers
    for host in servers:
        assert {"ansible_host", "bmc_address", "bmc_vendor"} <= set(hostvars[host]), host
        assert hostvars[host]["bmc_vendor"] in {"dell", "hpe", "generic"}
    (demo,) = inventory["demo"]["hosts"]
    assert hostvars[demo]["ansible_connection"] == "local"
    assert hostvars[demo]["bigmem_os_tuning_enabled"] == "false"


def test_installed_collections_are_the_pinned_ones():
    pinned = {entry["name"]: entry["version"]
              for entry in yaml.safe_load((ANSIBLE_DIR / "requirements.yml").read_text())["collections"]}
    result = run(tool("ansible-galaxy"), "collection", "list", "--format", "json")
    assert result.returncode == 0, result.stderr
    installed = {}
    for collections in json.loads(result.stdout).values():
        for name, info in collections.items():
            installed.setdefault(name, info["version"])
    for name, version in pinned.items():
        assert installed.get(name) == version, f"{name}: installed {installed.get(name)}, pinned {version}"


def role_defaults() -> dict[str, set[str]]:
    defaults = {}
    for path in sorted((ANSIBLE_DIR / "roles").glob("*/defaults/main.yml")):
        defaults[path.parts[-3]] = set(yaml.safe_load(path.read_text()) or {})
    return defaults


def test_every_role_default_is_prefixed_and_documented_in_group_vars():
    documented = set()
    for path in (ANSIBLE_DIR / "group_vars" / "all").glob("*.yml"):
        documented |= set(re.findall(r"^# (bigmem_\w+):", path.read_text(), flags=re.M))
    for role, names in role_defaults().items():
        for name in names:
            assert name.startswith(role + "_") or name.startswith("bigmem_"), f"{role}: {name} is not prefixed"
            assert name in documented, f"{role}: {name} is not shown in group_vars/all/"
    text = (ANSIBLE_DIR / "roles" / "bigmem" / "defaults" / "main.yml").read_text()
    for name in role_defaults()["bigmem"]:
        # Each knob is introduced by a comment line.
        assert re.search(rf"^#.*\n{name}:", text, flags=re.M), f"{name} has no comment above it"


def test_site_reads_like_a_table_of_contents():
    plays = yaml.safe_load((ANSIBLE_DIR / "site.yml").read_text())
    roles = [play["roles"][0] for play in plays]
    assert [role["role"] for role in roles] == ["bigmem_preflight", "bigmem_bios", "bigmem_os_tuning",
                                                "bigmem_docker_engine", "bigmem_image", "bigmem_train"]
    assert all(role.get("tags") for role in roles)
    assert all(role["when"].startswith("bigmem_") for role in roles[1:])
    for role in roles:
        assert (ANSIBLE_DIR / "roles" / role["role"] / "README.md").is_file()
