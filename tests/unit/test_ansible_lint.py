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
    pinned = {
        entry["name"]: entry["version"]
        for entry in yaml.safe_load((ANSIBLE_DIR / "requirements.yml").read_text())["collections"]
    }
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
            assert name.startswith(role + "_") or name.startswith("bigmem_"), (
                f"{role}: {name} is not prefixed"
            )
            assert name in documented, f"{role}: {name} is not shown in group_vars/all/"
    text = (ANSIBLE_DIR / "roles" / "bigmem" / "defaults" / "main.yml").read_text()
    for name in role_defaults()["bigmem"]:
        # Each knob is introduced by a comment line.
        assert re.search(rf"^#.*\n{name}:", text, flags=re.M), f"{name} has no comment above it"


def test_site_reads_like_a_table_of_contents():
    plays = yaml.safe_load((ANSIBLE_DIR / "site.yml").read_text())
    roles = [play["roles"][0] for play in plays]
    assert [role["role"] for role in roles] == [
        "bigmem_preflight",
        "bigmem_bios",
        "bigmem_os_tuning",
        "bigmem_reboot",
        "bigmem_docker_engine",
        "bigmem_image",
        "bigmem_slurm",
        "bigmem_train",
    ]
    assert all(role.get("tags") for role in roles)
    # Every stage has its feature flag; the reboot stage decides for itself (it has nothing to do unless
    # bios or os_tuning left something for the next boot), and runs with their tags.
    assert all(role["when"].startswith("bigmem_") for role in roles[1:] if role["role"] != "bigmem_reboot")
    reboot = roles[3]
    assert "when" not in reboot and {"bios", "os_tuning"} <= set(reboot["tags"])
    for role in roles:
        assert (ANSIBLE_DIR / "roles" / role["role"] / "README.md").is_file()


def _cfg(path: Path) -> dict[tuple[str, str], str]:
    import configparser

    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path)
    return {(section, key): value for section in parser.sections() for key, value in parser[section].items()}


def test_root_ansible_cfg_has_the_settings_of_the_ansible_folder():
    # Ansible reads only the ansible.cfg of the current folder: the root one must not drift from ansible/'s.
    root, inner = _cfg(REPO / "ansible.cfg"), _cfg(ANSIBLE_DIR / "ansible.cfg")
    assert root.keys() == inner.keys()
    paths = {
        ("defaults", "inventory"),
        ("defaults", "roles_path"),
        ("defaults", "filter_plugins"),
        ("defaults", "collections_path"),
    }
    for key in root.keys() - paths:
        assert root[key] == inner[key], key
    for key in paths:  # the same folders, each named from its own file's folder
        resolve = [
            [
                os.path.normpath(base / part) if not part.startswith(("~", "/")) else part
                for part in cfg[key].split(":")
            ]
            for base, cfg in ((REPO, root), (ANSIBLE_DIR, inner))
        ]
        assert resolve[0] == resolve[1], key


def _config_dump(cwd: Path) -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    env.pop("ANSIBLE_CONFIG", None)
    result = subprocess.run(
        [tool("ansible-config"), "dump", "--only-changed", "--format", "json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return {entry["name"]: entry["value"] for entry in json.loads(result.stdout) if "name" in entry}


def test_the_readme_command_works_from_the_repository_root():
    """`ansible-playbook site.yml` from the root: the playbook is found, ansible.cfg's settings apply."""
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    env.pop("ANSIBLE_CONFIG", None)
    result = subprocess.run(
        [tool("ansible-playbook"), "site.yml", "--syntax-check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    listed = subprocess.run(
        [tool("ansible-playbook"), "site.yml", "--list-tasks", "--limit", "demo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "bigmem_train : Run the job" in listed.stdout, listed.stdout
    root, inner = _config_dump(REPO), _config_dump(ANSIBLE_DIR)
    assert root["DEFAULT_BECOME"] is True and root["DEFAULT_HOST_LIST"] == [str(REPO / "inventory.ini")], root
    for name in ("DEFAULT_BECOME", "DEFAULT_HOST_LIST", "DEFAULT_ROLES_PATH", "DEFAULT_FILTER_PLUGIN_PATH"):
        assert root[name] == inner[name], name


def test_root_site_yml_passes_yamllint():
    result = subprocess.run(
        [tool("yamllint"), "--strict", "-c", str(ANSIBLE_DIR / ".yamllint"), "site.yml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
