"""`bigmem-train remote` against a real sshd on loopback (tests/fixtures/sshd.py), key login only,
running the real commands: start a tiny job detached (--no-docker), status, logs, stop, fetch; and the
one-line errors: unknown host, unreachable port, wrong key, no such job."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bigmem_train.ops.remote import load_inventory
from tests.fixtures.common import free_port, write_tiny_job

EXECUTABLE = Path(sys.executable).with_name("bigmem-train")


def remote(*args, inventory, timeout=300):
    """Run `bigmem-train remote ...` as a user would; returns the CompletedProcess (text)."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(
        [sys.executable, "-m", "bigmem_train.cli", "remote", *map(str, args), "--inventory", str(inventory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )


@pytest.fixture
def inventory(sshd, tmp_path) -> Path:
    """An Ansible INI inventory: the test sshd as host `lab`, plus hosts that must fail."""
    keys = tmp_path / "keys"
    keys.mkdir()
    # A key path relative to the inventory's folder, as it would travel with the inventory.
    (keys / "lab_ed25519").write_bytes(sshd.key_file.read_bytes())
    (keys / "lab_ed25519").chmod(0o600)
    path = tmp_path / "inventory.ini"
    path.write_text(f"""\
[labs]
lab ansible_host={sshd.host} ansible_port={sshd.port} ansible_ssh_private_key_file=keys/lab_ed25519

[labs:vars]
ansible_user={sshd.user}
bigmem_train_remote_dir={tmp_path}/remote
bigmem_train_executable={EXECUTABLE}

[broken]
closed-port ansible_host=127.0.0.1 ansible_port={free_port()} ansible_user={sshd.user} ansible_ssh_private_key_file={sshd.key_file}
wrong-key ansible_host=127.0.0.1 ansible_port={sshd.port} ansible_user={sshd.user} ansible_ssh_private_key_file={sshd.wrong_key_file}
""")
    yield path
    # A failed test must not leave a job training on the shared machine.
    for job_file in (tmp_path / "remote" / "jobs").glob("*/job.json"):
        pid = json.loads(job_file.read_text()).get("pid")
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_inventory_read_with_ansible_semantics(inventory, sshd, tmp_path):
    parsed = load_inventory(inventory)
    lab = parsed.host("lab")
    assert (lab.address, lab.port, lab.user) == (sshd.host, sshd.port, sshd.user)
    assert lab.key_file == str(tmp_path / "keys" / "lab_ed25519")
    assert lab.remote_dir == f"{tmp_path}/remote" and lab.executable == str(EXECUTABLE)
    assert parsed.groups["broken"] == ["closed-port", "wrong-key"]
    assert [host.name for host in parsed.targets("lab")] == ["lab"]


def test_unknown_host_is_bad_input(inventory):
    result = remote("status", "nowhere", "job", inventory=inventory)
    assert result.returncode == 2
    assert "'nowhere' is neither a host nor a group" in one_line(result)


def test_closed_port_is_unreachable(inventory):
    result = remote("status", "closed-port", "job", inventory=inventory)
    assert result.returncode == 4
    assert "closed-port" in one_line(result) and "connection refused" in one_line(result)


def test_wrong_key_is_refused(inventory, sshd):
    result = remote("status", "wrong-key", "job", inventory=inventory)
    assert result.returncode == 4
    assert f"login refused (key {sshd.wrong_key_file} not accepted" in one_line(result)


def test_no_such_job_is_bad_input(inventory):
    for action in (
        ["status", "lab", "ghost"],
        ["logs", "lab", "ghost"],
        ["stop", "lab", "ghost"],
        ["fetch", "lab", "ghost", "--to", "fetched"],
    ):
        result = remote(*action, inventory=inventory)
        assert result.returncode == 2, action
        assert "no job named ghost on lab" in one_line(result)


def test_bad_config_stops_before_the_host(inventory, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("training:\n  batch_size: 0\n")
    result = remote("start", "lab", "--config", config, "--name", "bad", "--no-docker", inventory=inventory)
    assert result.returncode == 2 and "training.batch_size" in one_line(result)
    assert not (tmp_path / "remote").exists()


def _status(inventory, name):
    result = remote("status", "lab", name, "--json", inventory=inventory)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _session(session_id: int) -> dict[int, str]:
    """The live processes of session ``session_id`` (PID -> command line), from /proc."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields: state, ppid, pgrp, session; a zombie is gone already (only its parent's wait is left).
        if int(fields[3]) == session_id and fields[0] != "Z":
            members[int(entry.name)] = command.strip()
    return members


def test_stop_ends_the_whole_job(inventory, tmp_path):
    config = write_tiny_job(tmp_path / "long.yaml", epochs=500)
    started = remote("start", "lab", "--config", config, "--name", "long", "--no-docker", inventory=inventory)
    assert started.returncode == 0, started.stderr
    assert "started long on lab (pid" in started.stdout
    job = json.loads((tmp_path / "remote" / "jobs" / "long" / "job.json").read_text())
    assert _status(inventory, "long")["state"] == "running"
    again = remote("start", "lab", "--config", config, "--name", "long", "--no-docker", inventory=inventory)
    assert again.returncode == 2 and "already running" in one_line(again)

    # The job is a session (setsid): its leader, the shell, and the training process below them. Read from
    # /proc, not from the kit: wait until the training process has started.
    deadline = time.monotonic() + 120
    while not any(
        "bigmem_train" in command or "bigmem-train" in command for command in _session(job["pid"]).values()
    ):
        assert time.monotonic() < deadline, (
            f"no training process in the job's session: {_session(job['pid'])}"
        )
        time.sleep(0.5)
    members = _session(job["pid"])
    assert len(members) >= 2, members

    stopped = remote("stop", "lab", "long", "--grace", "5", inventory=inventory)
    assert stopped.returncode == 0 and "long on lab: stopped" in stopped.stdout, stopped.stderr
    # Every process of the job is gone when stop returns (before the fixture's teardown kills the group).
    assert _session(job["pid"]) == {}, f"left running after stop: {_session(job['pid'])} (were {members})"
    assert _status(inventory, "long")["state"] == "stopped"
    assert "not running" in remote("stop", "lab", "long", inventory=inventory).stdout


@pytest.mark.slow
def test_start_follow_status_fetch_a_tiny_job(inventory, tmp_path):
    config = write_tiny_job(tmp_path / "tiny.yaml", epochs=2)
    started = remote("start", "lab", "--config", config, "--name", "tiny", "--no-docker", inventory=inventory)
    assert started.returncode == 0, started.stderr

    # Follow the log until the job ends: it streams the training and returns with it.
    began = time.monotonic()
    followed = remote("logs", "lab", "tiny", "--follow", inventory=inventory, timeout=900)
    assert followed.returncode == 0, followed.stderr
    assert "epoch 2/2 done in" in followed.stdout and "PASS" in followed.stdout, followed.stdout[-3000:]
    assert time.monotonic() - began > 5

    status = _status(inventory, "tiny")
    assert status["state"] == "finished" and status["verdict"] == "PASS"
    assert status["epoch"] == 2 and status["epochs"] == 2 and status["step"] == status["steps_per_epoch"] == 3
    assert status["peak_rss_bytes"] > 100 * 2**20 and status["live_rss_bytes"] == 0
    assert status["last_epoch"]["epoch"] == 1 and "val_dice" in status["last_epoch"]
    text = remote("status", "lab", "tiny", inventory=inventory).stdout
    assert "tiny on lab: finished" in text and "epoch 2/2, step 3/3" in text and "verdict: PASS" in text

    tail = remote("logs", "lab", "tiny", "--lines", "1", inventory=inventory)
    assert tail.stdout.strip().startswith("PASS")

    fetched = remote("fetch", "lab", "tiny", "--to", tmp_path / "fetched", inventory=inventory)
    assert fetched.returncode == 0, fetched.stderr
    assert "verdict PASS" in fetched.stdout
    run = tmp_path / "fetched" / "tiny"
    for name in (
        "verdict.json",
        "report.html",
        "metrics.json",
        "history.csv",
        "memory.csv",
        "job.log",
        "checkpoints/last.keras",
    ):
        assert (run / name).is_file(), name
    assert json.loads((run / "verdict.json").read_text())["verdict"] == "PASS"


@pytest.mark.slow
def test_start_a_two_worker_job_on_a_group(sshd, tmp_path):
    """`remote start GROUP`: one worker per host, TF_CONFIG rendered per host; both train in lockstep."""
    hosts = "\n".join(
        f"w{index} ansible_host=127.0.0.1 ansible_port={sshd.port} bigmem_train_worker_port={free_port()} "
        f"bigmem_train_remote_dir={tmp_path}/w{index}"
        for index in range(2)
    )
    inventory = tmp_path / "workers.ini"
    inventory.write_text(
        f"[workers]\n{hosts}\n\n[workers:vars]\nansible_user={sshd.user}\n"
        f"ansible_ssh_private_key_file={sshd.key_file}\nbigmem_train_executable={EXECUTABLE}\n"
    )
    config = write_tiny_job(tmp_path / "job.yaml", epochs=2, strategy="multi_worker")
    try:
        single = remote("start", "w0", "--config", config, "--name", "mw", "--no-docker", inventory=inventory)
        assert single.returncode == 2 and "give its group" in one_line(single)
        started = remote(
            "start", "workers", "--config", config, "--name", "mw", "--no-docker", inventory=inventory
        )
        assert started.returncode == 0, started.stderr
        assert "started mw on w0" in started.stdout and "started mw on w1" in started.stdout
        tf_config = json.loads(remote("tf-config", "w1", inventory=inventory).stdout)
        assert (
            tf_config["task"] == {"type": "worker", "index": 1} and len(tf_config["cluster"]["worker"]) == 2
        )

        followed = remote("logs", "w0", "mw", "--follow", inventory=inventory, timeout=900)
        assert "PASS" in followed.stdout, (
            followed.stdout[-3000:] + remote("logs", "w1", "mw", inventory=inventory).stdout[-3000:]
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            reports = json.loads(remote("status", "workers", "mw", "--json", inventory=inventory).stdout)
            if all(report["state"] != "running" for report in reports):
                break
            time.sleep(2)
        assert [report["state"] for report in reports] == ["finished", "finished"], reports
        assert reports[0]["verdict"] == "PASS" and reports[1]["run_dir"].endswith("results/mw.worker1")
    finally:
        remote("stop", "workers", "mw", "--grace", "2", inventory=inventory)
    chief = tmp_path / "w0" / "jobs" / "mw" / "results" / "mw"
    worker = tmp_path / "w1" / "jobs" / "mw" / "results" / "mw.worker1"
    assert (chief / "history.csv").read_text() == (worker / "history.csv").read_text()
    assert (chief / "checkpoints" / "last.keras").is_file() and (
        worker / "checkpoints" / "last.keras"
    ).is_file()


@pytest.mark.slow
@pytest.mark.docker
def test_container_job_over_ssh(inventory, tmp_path, bigmem_image):
    """The default mode: a detached hardened container on the host, its log, status and run directory.
    The image is the suite's own (docker_daemon.bigmem_image: built from this checkout, or BIGMEM_TEST_IMAGE)."""
    image = bigmem_image
    config = write_tiny_job(tmp_path / "tiny.yaml", epochs=2)
    try:
        started = remote(
            "start", "lab", "--config", config, "--name", "boxed", "--image", image, inventory=inventory
        )
        assert started.returncode == 0, started.stderr
        assert "started boxed on lab (container " in started.stdout
        followed = remote("logs", "lab", "boxed", "--follow", inventory=inventory, timeout=900)
        assert "PASS" in followed.stdout, followed.stdout[-3000:] + followed.stderr[-3000:]
        status = _status(inventory, "boxed")
        assert status["mode"] == "docker" and status["state"] == "finished" and status["verdict"] == "PASS"
        fetched = remote("fetch", "lab", "boxed", "--to", tmp_path / "fetched", inventory=inventory)
        assert fetched.returncode == 0 and "verdict PASS" in fetched.stdout, fetched.stderr
        assert "PASS" in (tmp_path / "fetched" / "boxed" / "job.log").read_text()
    finally:
        subprocess.run(["docker", "rm", "-f", "boxed"], capture_output=True, timeout=60)
