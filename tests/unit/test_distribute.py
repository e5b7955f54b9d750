"""Multi-worker helpers: TF_CONFIG parsing, worker naming, the shared template (also through Ansible)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.memory.plan import plan_job
from bigmem_train.ops.distribute import (
    config_for_this_worker,
    is_chief,
    parse_tf_config,
    per_worker_batch_size,
    render_tf_config,
    templates_dir,
    worker_count,
    worker_lost,
    worker_run_name,
)


def tf_config(index, workers=("a:1", "b:2")):
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


def test_parse_and_roles():
    cluster = parse_tf_config(tf_config(1))
    assert cluster.workers == ("a:1", "b:2") and cluster.index == 1 and cluster.count == 2
    assert not cluster.is_chief and parse_tf_config(tf_config(0)).is_chief
    assert is_chief({}) and worker_count({}) == 1
    assert not is_chief({"TF_CONFIG": tf_config(1)}) and worker_count({"TF_CONFIG": tf_config(1)}) == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ('{"cluster": {}}', 'needs "cluster" and "task"'),
        ('{"cluster": {"worker": ["nohost"]}, "task": {"type": "worker", "index": 0}}', "host:port"),
        (tf_config(2), "does not name one of the cluster's members"),
        (tf_config(0, ("a:1", "a:1")), "lists an address twice"),
        (tf_config(0, ("a:1", "b:99999")), "'b:99999' needs a host and a port from 1 to 65535"),
        (tf_config(0, ("a:1", ":2")), "':2' needs a host and a port"),
        (tf_config(0, ("a:1", "b:http")), "'b:http' needs a host and a port"),
    ],
)
def test_bad_tf_config_is_one_clear_line(text, message):
    with pytest.raises(BadInput, match=message):
        parse_tf_config(text)


def test_worker_run_directories_and_batch():
    assert worker_run_name("job", None) == "job"
    assert worker_run_name("job", parse_tf_config(tf_config(0))) == "job"
    assert worker_run_name("job", parse_tf_config(tf_config(1))) == "job.worker1"
    config = load_config(None, {"training.strategy": "multi_worker", "output.run_name": "job"})
    assert config_for_this_worker(config, {"TF_CONFIG": tf_config(1)}).output.run_name == "job.worker1"
    assert config_for_this_worker(config, {"TF_CONFIG": tf_config(0)}).output.run_name == "job"
    with pytest.raises(BadInput, match="needs the TF_CONFIG environment variable"):
        config_for_this_worker(config, {})
    unnamed = load_config(None, {"training.strategy": "multi_worker"})
    with pytest.raises(BadInput, match="needs output.run_name"):
        config_for_this_worker(unnamed, {"TF_CONFIG": tf_config(0)})
    assert per_worker_batch_size(config, 2) == config.training.batch_size // 2
    with pytest.raises(BadInput, match="divisible by the 3 workers"):
        per_worker_batch_size(load_config(None, {"training.batch_size": 4}), 3)


GROUPS = {"workers": ["w0", "w1", "w2"]}
HOSTVARS = {
    "w0": {"ansible_host": "192.0.2.10"},
    "w1": {"ansible_host": "192.0.2.11", "bigmem_train_worker_address": "10.0.0.11"},
    "w2": {"bigmem_train_worker_port": 2222},
}
EXPECTED = ["192.0.2.10:12345", "10.0.0.11:12345", "w2:2222"]


def test_template_renders_workers_in_inventory_order():
    for index, host in enumerate(GROUPS["workers"]):
        cluster = parse_tf_config(render_tf_config(GROUPS, HOSTVARS, host, "workers"))
        assert list(cluster.workers) == EXPECTED and cluster.index == index
    with pytest.raises(BadInput, match="not in inventory group"):
        render_tf_config(GROUPS, HOSTVARS, "elsewhere", "workers")
    bad_port = {**HOSTVARS, "w2": {"bigmem_train_worker_port": 99999}}
    with pytest.raises(BadInput, match="inventory group workers: .*'w2:99999'.*bigmem_train_worker_port"):
        render_tf_config(GROUPS, bad_port, "w0", "workers")


@pytest.mark.skipif(
    not shutil.which("ansible", path=str(Path(sys.executable).parent)), reason="needs ansible-core"
)
def test_ansible_renders_the_same_template(tmp_path):
    """One source of truth: Ansible's templating gives the same TF_CONFIG as the CLI."""
    inventory = tmp_path / "inventory.ini"
    lines = ["[workers]"]
    for host in GROUPS["workers"]:
        variables = " ".join(f"{key}={value}" for key, value in HOSTVARS[host].items())
        lines.append(f"{host} ansible_connection=local {variables}")
    inventory.write_text("\n".join(lines) + "\n")
    template = templates_dir() / "tf_config.json.j2"
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible")),
            "workers",
            "-i",
            str(inventory),
            "-o",
            "-m",
            "debug",
            "-a",
            f"msg={{{{ lookup('template', '{template}') }}}}",
            "-e",
            "bigmem_train_group=workers",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rendered = {}
    for line in result.stdout.splitlines():
        host, _, rest = line.partition(" | SUCCESS => ")
        rendered[host] = json.loads(rest)["msg"].strip()
    # One line per host of the group, each the CLI's rendering for that host (not a pass on no output).
    assert sorted(rendered) == sorted(GROUPS["workers"]), result.stdout
    for host, message in rendered.items():
        assert message == render_tf_config(GROUPS, HOSTVARS, host, "workers")


def test_planner_plans_one_replica_per_host(monkeypatch):
    single = load_config(None, {"training.batch_size": 4})
    multi = load_config(None, {"training.batch_size": 4, "training.strategy": "multi_worker"})
    monkeypatch.setenv("TF_CONFIG", tf_config(0))
    single_plan, multi_plan = plan_job(single, None), plan_job(multi, None)
    assert single_plan.workers == 1 and "allreduce_buffers" not in single_plan.breakdown
    assert multi_plan.workers == 2 and multi_plan.to_dict()["batch_size_per_worker"] == 2
    # Per-replica activations are half the single host's (the fitted activation factor rounds each to a byte).
    assert abs(multi_plan.breakdown["activations"] * 2 - single_plan.breakdown["activations"]) <= 2
    assert multi_plan.breakdown["allreduce_buffers"] == multi_plan.breakdown["gradients"]
    assert multi_plan.breakdown["weights"] == single_plan.breakdown["weights"]


# TensorFlow 2.21's texts (abridged) when worker 1 of two went silent past the heartbeat timeout.
CHIEF_SAW = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/replica:0/task:0/"
    "device:CPU:0}} Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks "
    "are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed."
)
WORKER_SAW = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/replica:0/task:1/"
    "device:CPU:0}} Collective ops is aborted by: Failed to send RPC to coordination service. Either the "
    "leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues."
)

# ... or, once the chief had stopped, a collective op's call to it.
WORKER_SAW_LATER = (
    "Collective ops is aborted by: failed to connect to all addresses; last error: UNKNOWN: "
    "ipv4:127.0.0.1:34451: Failed to connect to remote host: Connection refused\nAdditional GRPC error "
    "information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.WorkerService/CompleteInstance:"
)

# ... or, the silent worker itself once it ran again: the chief's verdict relayed, with gRPC's note naming
# the chief after it (a loaded CI host, 7 December).
SILENT_WORKER_SAW = (
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy "
    "(stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs "
    "for an earlier error.\nThe error could be from a previous operation. Restart your program to reset.\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.WorkerService/CompleteInstance:"
)


def test_a_lost_worker_is_one_line_naming_it():
    config = load_config(None, {"training.strategy": "multi_worker", "training.worker_heartbeat_timeout": 30})
    environ = {"TF_CONFIG": tf_config(0)}
    lost = worker_lost(RuntimeError(CHIEF_SAW), config, environ)
    assert lost is not None and lost.exit_code == 1
    assert str(lost).startswith("multi-worker job stopped: worker 1 (b:2) sent no heartbeat for 30 s")
    assert "\n" not in str(lost)
    lost = worker_lost(RuntimeError(WORKER_SAW), config, {"TF_CONFIG": tf_config(1)})
    assert "this worker lost the chief, worker 0 (a:1), which holds the coordination service" in str(lost)
    lost = worker_lost(RuntimeError(WORKER_SAW_LATER), config, {"TF_CONFIG": tf_config(1)})
    assert "this worker lost worker 0 (a:1): it stopped, or stopped the job" in str(lost)
    # Only the listed task went silent, not the chief that gRPC's note names after the list.
    lost = worker_lost(RuntimeError(SILENT_WORKER_SAW), config, {"TF_CONFIG": tf_config(1)})
    assert str(lost).startswith(
        "multi-worker job stopped: this worker, worker 1 (b:2), sent no heartbeat for 30 s"
    )
    lost = worker_lost(RuntimeError(SILENT_WORKER_SAW), config, environ)
    assert str(lost).startswith("multi-worker job stopped: worker 1 (b:2) sent no heartbeat for 30 s")
    assert worker_lost(RuntimeError("Conv3D: out of range"), config, environ) is None
    assert worker_lost(RuntimeError(CHIEF_SAW), load_config(None), environ) is None
