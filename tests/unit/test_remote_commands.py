"""The shell commands `remote start` runs on a host, and the inventory's connection settings."""

import pytest

from bigmem_train.errors import BadInput
from bigmem_train.ops.remote import (
    HARDENED_DOCKER_FLAGS,
    check_job_name,
    docker_run_command,
    load_inventory,
    process_command,
)


def test_docker_run_is_hardened_and_mounts_the_job():
    command = docker_run_command("job-1", "bigmem-train:1.0", "jobs/job-1", "job-1", "/srv/Task01", {})
    assert command.startswith('docker run -d --name job-1 --user "$(id -u):$(id -g)" ')
    assert " ".join(HARDENED_DOCKER_FLAGS) in command
    assert '-v "$PWD/results":/results' in command and '-v "$PWD/config.yaml":/config/job.yaml:ro' in command
    assert "-v /srv/Task01:/data:ro" in command and command.endswith("--run-name job-1 --data /data")
    assert "--network none" in command and "--cap-add" not in command
    assert "--cap-add SYS_NICE" in docker_run_command(
        "job", "image", "jobs/job", "job", None, {}, numa_nodes=2
    )


def test_multi_worker_container_uses_host_network_and_tf_config():
    command = docker_run_command("mw", "bigmem-train", "jobs/mw", "mw", None, {"TF_CONFIG": '{"a": 1}'})
    assert "--network host" in command and "-e 'TF_CONFIG={\"a\": 1}'" in command


def test_process_mode_runs_detached_in_its_own_session():
    command = process_command("/opt/venv/bin/bigmem-train", "job", None, {"TF_CONFIG": "{}"})
    assert command.startswith("TF_CONFIG='{}' setsid nohup sh -c ")
    assert "run --config config.yaml --results results --run-name job; echo $? > exit_code" in command
    assert command.endswith("> job.log 2>&1 < /dev/null & echo $!")


@pytest.mark.parametrize("name", ["", "-x", "a/b", "a b", "x" * 200])
def test_bad_job_names(name):
    with pytest.raises(BadInput, match="job name"):
        check_job_name(name)


def test_inventory_connection_settings(tmp_path):
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "lab.yml").write_text("ansible_port: 2200\nbigmem_train_remote_dir: ~/jobs\n")
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[lab]\nnode[1:2] ansible_user=ops ansible_ssh_private_key_file=keys/id\n"
        "other ansible_host=192.0.2.5 ansible_port=22\n"
    )
    parsed = load_inventory(inventory)
    node = parsed.host("node1")
    assert (node.address, node.port, node.user) == ("node1", 2200, "ops")
    assert node.key_file == str(tmp_path / "keys" / "id") and node.remote_dir == "jobs"
    assert parsed.host("other").port == 22 and parsed.host("other").user is None
    assert [host.name for host in parsed.targets("lab")] == ["node1", "node2", "other"]
    with pytest.raises(BadInput, match="'nowhere' is neither a host nor a group"):
        parsed.targets("nowhere")
    with pytest.raises(BadInput, match="does not exist"):
        load_inventory(tmp_path / "missing.ini")


@pytest.mark.parametrize(
    "name, text, reason",
    [
        ("inventory.ini", "[lab\nnode1\n", r"an unclosed \[section\]"),
        (
            "inventory.ini",
            "[lab:vars]\nansible_user=ops\n",
            "Section \\[lab:vars\\] not valid for undefined group",
        ),
        ("inventory.ini", "[lab]\nnode1 garbage\n", "Expected key=value host variable assignment"),
        ("inventory.yml", "all:\n  hosts: [\n", "YAML parsing failed"),
    ],
)
def test_an_inventory_ansible_cannot_read_gives_ansibles_reason(tmp_path, name, text, reason):
    (tmp_path / name).write_text(text)
    with pytest.raises(BadInput, match=f"inventory .*{name} has no hosts: .*{reason}") as error:
        load_inventory(tmp_path / name)
    assert "\n" not in str(error.value)


def test_an_inventory_with_an_empty_group_has_no_hosts(tmp_path):
    (tmp_path / "inventory.ini").write_text("[lab]\n")
    with pytest.raises(BadInput, match=r"has no hosts \(is it an Ansible INI or YAML inventory\?\)"):
        load_inventory(tmp_path / "inventory.ini")
