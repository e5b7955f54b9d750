"""The shell commands `remote start` and `remote predict` run on a host, what `remote status` makes of a
predict job's files, and the inventory's connection settings."""

import json
import re

import pytest

from bigmem_train.cli import build_parser
from bigmem_train.cli.apply import predict_option_flags
from bigmem_train.errors import BadInput
from bigmem_train.ops.hosts import RemoteHost
from bigmem_train.ops.remote import (
    HARDENED_DOCKER_FLAGS,
    check_job_name,
    docker_run_command,
    format_status,
    load_inventory,
    process_command,
)
from bigmem_train.ops.remote_predict import (
    HostPath,
    PredictInputs,
    predict_docker_command,
    predict_process_command,
)
from bigmem_train.ops.status import _predict_report


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


def _mounts(command: str) -> dict[str, str]:
    """`-v SOURCE:TARGET[:ro]` of a docker command line: target -> "ro" or "rw"."""
    mounts = {}
    for volume in re.findall(r"-v (\S+)", command):
        parts = volume.split(":")
        mounts[parts[1]] = "ro" if parts[2:] == ["ro"] else "rw"
    return mounts


def test_predict_container_reads_its_inputs_read_only_without_network():
    inputs = PredictInputs("/srv/runs/brats", "", HostPath("/srv/Task01", True), "/srv/Task01/labelsTr")
    command = predict_docker_command("p1", "bigmem-train:1.0", inputs, ["--tta"])
    assert command.startswith('docker run -d --name p1 --user "$(id -u):$(id -g)" ')
    assert " ".join(HARDENED_DOCKER_FLAGS) in command and "--network none" in command
    assert "--cap-add" not in command and "-e " not in command
    assert _mounts(command) == {"/results": "rw", "/model": "ro", "/data": "ro", "/labels": "ro"}
    assert '-v "$PWD/results":/results ' in command and "-v /srv/runs/brats:/model:ro" in command
    assert "-v /srv/Task01:/data:ro" in command and "-v /srv/Task01/labelsTr:/labels:ro" in command
    # Two commands, so a shell runs them; evaluate only when predict succeeded.
    assert command.endswith(
        "--entrypoint sh bigmem-train:1.0 -c 'bigmem-train predict --model /model --data /data "
        "--out /results/p1 --tta && bigmem-train evaluate --pred /results/p1 --labels /labels'"
    )


def test_predict_container_of_one_image_and_checkpoint_uses_the_entrypoint():
    inputs = PredictInputs(
        "/srv/runs/brats", "checkpoints/last.keras", HostPath("/srv/scans/case_1.nii.gz", False)
    )
    command = predict_docker_command("p2", "bigmem-train", inputs, [])
    # The image keeps its name (its case name) under /data.
    assert _mounts(command) == {"/results": "rw", "/model": "ro", "/data/case_1.nii.gz": "ro"}
    assert "--network none" in command and "--entrypoint" not in command
    assert command.endswith(
        "bigmem-train predict --model /model/checkpoints/last.keras --data /data/case_1.nii.gz --out /results/p2"
    )
    spaced = predict_docker_command(
        "p3", "bigmem-train", PredictInputs("/r", "", HostPath("/s/a b.nii", False)), []
    )
    assert "-v '/s/a b.nii':'/data/a b.nii':ro" in spaced and spaced.endswith(
        "--data '/data/a b.nii' --out /results/p3"
    )


def test_predict_process_runs_detached_and_keeps_the_first_failure():
    inputs = PredictInputs("/srv/runs/brats", "", HostPath("/srv/Task01", True), "/srv/labels")
    command = predict_process_command("/opt/venv/bin/bigmem-train", "p1", inputs, ["--subset", "training"])
    assert command.startswith("setsid nohup sh -c ")
    assert (
        "/opt/venv/bin/bigmem-train predict --model /srv/runs/brats --data /srv/Task01 --out results/p1 "
        "--subset training && /opt/venv/bin/bigmem-train evaluate --pred results/p1 --labels /srv/labels; "
        "echo $? > exit_code"
    ) in command
    assert command.endswith("> job.log 2>&1 < /dev/null & echo $!")
    alone = predict_process_command("bigmem-train", "p1", PredictInputs("/r", "", HostPath("/d", True)), [])
    assert "evaluate" not in alone


def test_remote_predict_passes_predicts_options_on():
    args = build_parser().parse_args(
        [
            "remote",
            "predict",
            "lab",
            "--job",
            "j",
            "--data",
            "d",
            "--tta",
            "--tile",
            "8,8,8",
            "--target",
            "8GiB",
        ]
    )
    assert args.host == "lab"  # not clobbered by --target, predict's option
    assert predict_option_flags(args) == [
        "--subset", "test", "--engine", "auto", "--precision", "auto", "--tta",
        "--target", "8GiB", "--tile", "8,8,8",
    ]  # fmt: skip


def test_status_of_a_predict_job():
    host = RemoteHost("lab", "127.0.0.1", 22, None, None, "ssh")
    job = {"folder": "jobs/p1", "run_dir": "results/p1", "mode": "docker", "container": "p1"}
    cases = {"a": {"peak_rss_bytes": 2**30}, "b": {"peak_rss_bytes": 3 * 2**30}}
    summary = {"foreground": {"cases": 2, "mean_dice": 0.9, "pooled_dice": 0.91, "median_hd95_mm": 1.5}}
    sections = {
        "predict": json.dumps({"cases_total": 3, "cases": cases}),
        "evaluation": json.dumps({"summary": summary}),
        "container": "false 0",
    }
    running = _predict_report(host, "p1", job, True, sections)
    assert (running["state"], running["exit_code"]) == ("running", None)
    assert (
        running["cases_done"] == 2 and running["cases_total"] == 3 and running["peak_rss_bytes"] == 3 * 2**30
    )
    finished = _predict_report(host, "p1", job, False, sections)
    assert (finished["state"], finished["exit_code"]) == ("finished", 0)
    text = format_status(finished)
    assert text.startswith("p1 on lab: finished\n  predicted 2/3 case(s)\n")
    assert "evaluation foreground: Dice mean 0.9000 (pooled 0.9100), HD95 median 1.50 mm, 2 case(s)" in text
    failed = _predict_report(host, "p1", job, False, {"container": "false 3"})
    assert (failed["state"], failed["exit_code"], failed["cases_done"]) == ("failed", 3, 0)
    assert format_status(failed).startswith("p1 on lab: failed (exit code 3)\n  predicted 0 case(s)")
    process = {**job, "mode": "process", "pid": 1}
    assert _predict_report(host, "p1", process, False, {})["state"] == "gone"
    assert _predict_report(host, "p1", {**process, "stopped": "now"}, False, {})["state"] == "stopped"


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


def test_without_ansible_the_error_points_to_the_setup_script(tmp_path, monkeypatch):
    """No package named bigmem-train is published: the way to the ops tools is the kit's setup script."""
    import sys

    from bigmem_train.ops.hosts import load_inventory

    inventory = tmp_path / "inventory.ini"
    inventory.write_text("[bigmem]\nbigmem-01\n")
    monkeypatch.setitem(sys.modules, "ansible.inventory.manager", None)
    with pytest.raises(BadInput, match=r"bash scripts/setup\.sh --ops") as error:
        load_inventory(inventory)
    assert "pip install" not in str(error.value)
