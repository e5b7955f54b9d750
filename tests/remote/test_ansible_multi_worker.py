"""Ansible's train role runs a multi-worker job for real, by the remote guide's command as written
(``ansible-playbook site.yml --limit bigmem --tags train -e @multi-worker.yml``, taken from the page by
tests/fixtures/doc_blocks.py): from a copy of ansible/ whose inventory beside it names two hosts of group
bigmem that are both this machine (ansible_connection=local, worker ports on 127.0.0.1, their own results
folders), and whose multi-worker.yml holds a tiny job. Preflight (tagged always) plans each host's share;
the train stage starts one container per host in the local Docker daemon with the kit's image, together,
with host networking and TF_CONFIG from templates/tf_config.json.j2. The play passes only when the chief's
verdict passes and every worker finished; both workers end with identical weights; the command run again
changes nothing.

A second test gives worker 1 a dataset folder without dataset.json: it ends at once, and the play
stops the chief (which waits for it) and fails with one message naming both workers, within one round of
bigmem_train_join_check rather than waiting out bigmem_train_start_timeout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from bigmem_train.ops.distribute import parse_tf_config, render_tf_config
from tests.fixtures.common import free_port, results_folder
from tests.fixtures.doc_blocks import ANSIBLE_MULTI_WORKER, WHERE, Block, all_blocks, run_commands, unexpected

from .test_multi_worker import assert_trained_in_lockstep

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("local_training_jobs_alone")]

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

# The guide's two hosts (docs/guides/remote-and-scale-out.md, step 2 of "How"), both this machine.
HOSTS = ["bigmem-01", "bigmem-02"]

# The tiny U-Net of the loopback test, rendered through templates/train.yaml.j2 like any Ansible job:
# 12 cases: the split gives 9 training and 3 validation, evened to 8 and 4 (whole global batches of 2).
JOB = {
    "strategy": "multi_worker",
    "synthetic_cases": 12,
    "synthetic_shape": [24, 24, 16],
    "input_shape": [16, 16, 16],
    "crop_jitter": 2,
    "depth": 2,
    "base_filters": 4,
    "batch_size": 2,
    "epochs": 3,
    "dice_floor": 0.0,
    "intra_op_threads": 1,
}

PLAYBOOK = """\
- name: Run the training job and check its verdict
  hosts: workers
  gather_facts: true
  roles:
    - role: bigmem_train
"""


def write_local_inventory(
    path: Path, group: str, hostvars: dict[str, dict], group_vars: tuple[str, ...] = ()
) -> None:
    """An inventory of ``group``: each host of ``hostvars`` on its line with its variables, all of them this
    machine (local connection, this Python, worker address 127.0.0.1), and ``group_vars`` lines beside."""
    lines = [f"[{group}]"]
    for host, values in hostvars.items():
        lines.append(" ".join([host, *(f"{key}={value}" for key, value in values.items())]))
    lines += [
        "",
        f"[{group}:vars]",
        "ansible_connection=local",
        f"ansible_python_interpreter={sys.executable}",
        "ansible_become=false",
        "bigmem_train_worker_address=127.0.0.1",
        *group_vars,
    ]
    path.write_text("\n".join(lines) + "\n")


def write_play(
    folder: Path, image: str, hostvars: dict[str, dict[str, str]], **variables
) -> tuple[Path, Path]:
    """An inventory of two local hosts (group `workers`), the playbook and its extra variables."""
    write_local_inventory(folder / "inventory.ini", "workers", hostvars)
    (folder / "train.yml").write_text(PLAYBOOK)
    name, _, tag = image.partition(":")
    extra = {
        "bigmem_train_group": "workers",
        "bigmem_train_job": JOB,
        "bigmem_train_templates_dir": str(REPO / "templates"),
        "bigmem_train_fetch_dir": str(folder / "fetched"),
        "bigmem_image_name": name,
        "bigmem_image_tag": tag or "latest",
        "bigmem_train_poll": 3,
        "bigmem_train_timeout": 900,
        **variables,
    }
    (folder / "extra.json").write_text(json.dumps(extra))
    return folder / "inventory.ini", folder / "train.yml"


def play(folder: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    environment = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles"),
        "ANSIBLE_FILTER_PLUGINS": str(REPO / "ansible" / "filter_plugins"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_HOST_KEY_CHECKING": "false",
        "ANSIBLE_RETRY_FILES_ENABLED": "false",
    }
    started = time.monotonic()
    result = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", "inventory.ini", "-e", "@extra.json", "train.yml"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )
    return result, time.monotonic() - started


def leftover_containers(prefix: str) -> list[str]:
    output = subprocess.run(
        ["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True
    ).stdout
    return [name for name in output.split() if name.startswith(prefix)]


@pytest.fixture
def ansible_playbook() -> Path:
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("ansible-playbook not installed (pip install '.[ops]')")
    if os.geteuid() != 0:
        pytest.skip("the train role sets the results folder's owner to the container user (needs root)")
    return ANSIBLE_PLAYBOOK


def guide_block() -> Block:
    """The remote guide's Ansible block, the one whose place (tests/fixtures/doc_blocks.WHERE) is this file."""
    blocks = [
        block for block in all_blocks() if getattr(WHERE.get(block.key), "runs", None) == ANSIBLE_MULTI_WORKER
    ]
    assert len(blocks) == 1 and len(blocks[0].commands) == 1, blocks
    assert blocks[0].commands[0].startswith("ansible-playbook site.yml --limit bigmem --tags train"), blocks
    return blocks[0]


def guide_checkout(folder: Path, image: str, ports: list[int]) -> Path:
    """What the guide's reader has in ``folder``: ansible/ with the kit's playbook, settings, roles and
    group_vars, the inventory beside it (where ansible.cfg looks: ../inventory.ini), templates/, and
    ansible/multi-worker.yml with the tiny job. Returns ansible/, where the command runs."""
    ansible = folder / "ansible"
    ansible.mkdir()
    # Files, not links: the playbook's folder (playbook_dir) and the settings' relative paths are this one.
    for name in ("ansible.cfg", "site.yml"):
        shutil.copy(REPO / "ansible" / name, ansible / name)
    for name in ("roles", "filter_plugins", "group_vars"):
        (ansible / name).symlink_to(REPO / "ansible" / name)
    (folder / "templates").symlink_to(REPO / "templates")
    name, _, tag = image.partition(":")
    # Numbers on the hosts' lines: Ansible reads those as literals, [group:vars] values as strings.
    settings = {"bigmem_train_poll": 3, "bigmem_train_timeout": 900}
    hostvars = {
        host: {
            **settings,
            "bigmem_train_worker_port": port,
            "bigmem_train_results_dir": results_folder(folder / host),
        }
        for host, port in zip(HOSTS, ports)
    }
    group_vars = (
        # The hosts are this machine, whatever it runs; tests/lab checks the OS checks on a real server.
        "bigmem_preflight_check_os=false",
        f"bigmem_image_name={name}",
        f"bigmem_image_tag={tag or 'latest'}",
    )
    write_local_inventory(folder / "inventory.ini", "bigmem", hostvars, group_vars)
    (ansible / "multi-worker.yml").write_text(yaml.safe_dump({"bigmem_train_job": JOB}, sort_keys=False))
    return ansible


def test_train_role_runs_two_workers_of_one_job(tmp_path, bigmem_image, ansible_playbook):
    block = guide_block()
    ports = [free_port(), free_port()]
    ansible = guide_checkout(tmp_path, bigmem_image, ports)
    environment = {
        "PATH": f"{ansible_playbook.parent}{os.pathsep}{os.environ['PATH']}",
        "ANSIBLE_NOCOLOR": "1",
    }

    def play() -> str:
        started = time.monotonic()
        ran = run_commands(block, ansible, environment, paths={}, timeout=900)
        print(f"\nmulti-worker play: {time.monotonic() - started:.0f} s", file=sys.stderr)
        assert unexpected(block, ran) == [], "\n".join(unexpected(block, ran))
        return ran.outputs[0]

    output = play()
    assert output.count("failed=0") == 2, output[-6000:]
    assert "PASS ansible-" in output and "on 2 workers (bigmem-01, bigmem-02)" in output, output[-6000:]
    # Preflight planned each host's share of the global batch (the YAML callback folds long messages).
    assert " ".join(output.split()).count("per host: 2 workers, batch 1 each") == 2, output[-6000:]

    # One job: the same run name on both hosts, each with its own TF_CONFIG from the shared template.
    chief_runs = [path for path in (tmp_path / HOSTS[0]).iterdir() if (path / "verdict.json").exists()]
    assert len(chief_runs) == 1, list((tmp_path / HOSTS[0]).iterdir())
    run = chief_runs[0].name
    chief, worker = tmp_path / HOSTS[0] / run, tmp_path / HOSTS[1] / f"{run}.worker1"
    groups = {"bigmem": HOSTS}
    template_vars = {
        host: {"bigmem_train_worker_address": "127.0.0.1", "bigmem_train_worker_port": port}
        for host, port in zip(HOSTS, ports)
    }
    for index, host in enumerate(HOSTS):
        written = (tmp_path / host / f"{run}.tf_config.json").read_text().strip()
        assert written == render_tf_config(groups, template_vars, host, "bigmem"), "Ansible and the CLI agree"
        cluster = parse_tf_config(written)
        assert cluster.index == index and cluster.workers == tuple(f"127.0.0.1:{port}" for port in ports)

    # Both ran as workers of that job, to the end; only the chief validated.
    assert json.loads((chief / "verdict.json").read_text())["verdict"] == "PASS"
    assert not (worker / "verdict.json").exists()
    for run_dir in (chief, worker):
        assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["strategy"] == "multi_worker" and metrics["workers"] == 2
        assert metrics["epochs_completed"] == JOB["epochs"] and metrics["steps"] == 4 * JOB["epochs"]
        assert (metrics["validation_cases"], metrics["validation_padded_samples"]) == (4, 0)  # 3 evened to 4
        split = json.loads((run_dir / "split.json").read_text())
        assert (len(split["train"]), len(split["validation"])) == (8, 4)
    assert_trained_in_lockstep(chief, worker)

    metrics_before = json.loads((chief / "metrics.json").read_text())["train_seconds_this_session"]

    # Each host's run directory was fetched to the controller (the role's default: results/ansible/ beside
    # ansible/).
    fetched = tmp_path / "results" / "ansible"
    assert json.loads((fetched / HOSTS[0] / run / "verdict.json").read_text())["verdict"] == "PASS"
    assert (fetched / HOSTS[1] / f"{run}.worker1" / "state.json").exists()
    assert not leftover_containers(f"bigmem-{run}-")

    # The command again finds the chief's verdict: nothing runs again, nothing changes, the check still passes.
    again = play()
    assert again.count("changed=0") == 2 and "PASS " + run in again, again[-6000:]
    assert json.loads((chief / "metrics.json").read_text())["train_seconds_this_session"] == metrics_before


def test_a_worker_that_cannot_start_fails_the_play(tmp_path, bigmem_image, ansible_playbook):
    no_dataset = tmp_path / "no-dataset"
    no_dataset.mkdir()
    hostvars = {
        "w0": {
            "bigmem_train_worker_port": free_port(),
            "bigmem_train_results_dir": results_folder(tmp_path / "w0"),
        },
        "w1": {
            "bigmem_train_worker_port": free_port(),
            "bigmem_train_results_dir": results_folder(tmp_path / "w1"),
            "bigmem_train_dataset_path": no_dataset,
        },
    }
    # The start timeout is long; the workers compare notes every 9 s, so worker 1's end stops worker 0's
    # wait at the end of that round, not when the timeout runs out.
    start_timeout = 900
    write_play(
        tmp_path, bigmem_image, hostvars, bigmem_train_start_timeout=start_timeout, bigmem_train_join_check=9
    )
    result, seconds = play(tmp_path, timeout=start_timeout)
    output = result.stdout + result.stderr
    print(f"\nfailed multi-worker play: {seconds:.0f} s", file=sys.stderr)
    assert result.returncode != 0, output[-6000:]
    assert "did not start: a worker ended before all had joined" in output, output[-6000:]
    assert seconds < start_timeout / 3, f"the play waited {seconds:.0f} s for a worker that had ended"
    assert "worker 1 (w1) ended with exit code 2" in output and "dataset.json" in output, output[-6000:]
    assert "worker 0 (w0) was still waiting for the others" in output, output[-6000:]
    # Stopped, not left waiting: no container of the job remains.
    run = next(path.stem for path in (tmp_path / "w0").glob("ansible-*.yaml"))
    assert not leftover_containers(f"bigmem-{run}-")
