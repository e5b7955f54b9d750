"""`bigmem-train remote` against a real sshd on loopback (tests/fixtures/sshd.py), key login only,
running the real commands: start a tiny job detached (--no-docker), status, logs, stop, fetch; predict
with it on the host and evaluate; and the one-line errors: unknown host, unreachable port, wrong key, no
such job, a predict whose model, data or name the host does not have or cannot give."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import pytest

import bigmem_train
from bigmem_train.ops.remote import load_inventory
from tests.fixtures.common import free_port, write_tiny_job


def host_executable(folder: Path) -> Path:
    """The host's `bigmem-train`: the package under test, wherever the environment's entry point points."""
    source = Path(bigmem_train.__file__).resolve().parents[1]
    script = folder / "bigmem-train"
    script.write_text(
        f'#!/bin/sh\nPYTHONPATH={source}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -m bigmem_train.cli "$@"\n'
    )
    script.chmod(0o755)
    return script


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
    (tmp_path / "bin").mkdir()
    executable = host_executable(tmp_path / "bin")
    path.write_text(f"""\
[labs]
lab ansible_host={sshd.host} ansible_port={sshd.port} ansible_ssh_private_key_file=keys/lab_ed25519

[labs:vars]
ansible_user={sshd.user}
bigmem_train_remote_dir={tmp_path}/remote
bigmem_train_executable={executable}

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
    assert lab.remote_dir == f"{tmp_path}/remote" and lab.executable == str(tmp_path / "bin" / "bigmem-train")
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

    # Its name is taken for good: a second start is refused on the workstation, the finished job left as it is.
    job_file = tmp_path / "remote" / "jobs" / "tiny" / "job.json"
    before = job_file.read_text()
    again = remote("start", "lab", "--config", config, "--name", "tiny", "--no-docker", inventory=inventory)
    assert again.returncode == 2 and "job tiny on lab already finished" in one_line(again), again.stderr
    assert job_file.read_text() == before
    assert (tmp_path / "remote" / "jobs" / "tiny" / "exit_code").read_text().strip() == "0"

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
        f"ansible_ssh_private_key_file={sshd.key_file}\nbigmem_train_executable={host_executable(tmp_path)}\n"
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

        # Predict with the container job's model in a container of its own (model, images and labels
        # mounted read-only, no network): masks and evaluation land in its results/ and come back.
        dataset = next((tmp_path / "remote" / "jobs" / "boxed" / "results").glob("synthetic-*"))
        images = sorted((dataset / "imagesTr").glob("*.nii.gz"))
        started = remote(
            "predict", "lab", "--job", "boxed", "--data", dataset / "imagesTr", "--labels", dataset / "labelsTr",
            "--name", "boxed-predict", "--image", image, inventory=inventory,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        assert "started boxed-predict on lab (container " in started.stdout, started.stdout
        followed = remote("logs", "lab", "boxed-predict", "--follow", inventory=inventory, timeout=900)
        assert f"PREDICTED {len(images)} case(s)" in followed.stdout, followed.stdout[-3000:]
        status = _status(inventory, "boxed-predict")
        assert (status["mode"], status["command"], status["state"], status["exit_code"]) == (
            "docker", "predict", "finished", 0,
        ), status  # fmt: skip
        assert status["evaluation"]["foreground"]["cases"] == len(images)
        fetched = remote("fetch", "lab", "boxed-predict", "--to", tmp_path / "fetched", inventory=inventory)
        assert fetched.returncode == 0, fetched.stderr
        out = tmp_path / "fetched" / "boxed-predict"
        for image_path in images:
            mask = nib.load(out / image_path.name)
            assert mask.shape == nib.load(image_path).shape[:3] and mask.get_data_dtype() == "uint8"
    finally:
        for container in ("boxed", "boxed-predict"):
            subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)


# --- remote predict ------------------------------------------------------------------------------------


def _fake_job(tmp_path: Path, name: str, **fields) -> Path:
    """A job folder on the test host as `remote start` leaves it, written directly. By default a container
    job whose container does not exist: not running, and no pid for the fixture's teardown to signal."""
    folder = tmp_path / "remote" / "jobs" / name
    (folder / "results").mkdir(parents=True)
    job = {
        "name": name,
        "mode": "docker",
        "container": f"bigmem-test-absent-{name}",
        "run_dir": f"results/{name}",
    }
    (folder / "job.json").write_text(json.dumps({**job, **fields}))
    return folder


def _fake_run(folder: Path, checkpoint: bool = True) -> Path:
    """The files `remote predict` looks for on the host in a run directory (what they hold is predict's
    concern: these are not a model, so a predict started with them fails on the host)."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("{}\n")
    if checkpoint:
        (folder / "checkpoints" / "best.keras").write_bytes(b"")
    return folder


def test_predict_refuses_bad_input_before_starting(inventory, tmp_path):
    images, run = tmp_path / "images", _fake_run(tmp_path / "runs" / "trained")
    images.mkdir()
    _fake_job(tmp_path, "fresh")  # a training job without a run directory yet
    _fake_run(_fake_job(tmp_path, "untrained") / "results" / "untrained", checkpoint=False)
    _fake_job(tmp_path, "predicted", command="predict")
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        _fake_job(tmp_path, "busy", mode="process", pid=sleeper.pid)  # a training job that is running
        model = ["--model", run, "--data", images]
        cases = [
            (["nowhere", "--job", "fresh", "--data", images], "host 'nowhere' is not in inventory"),
            (["lab", "--data", images], "give either --model"),
            (["lab", *model, "--job", "fresh"], "give either --model"),
            (["lab", *model, "--tile", "8,8"], "--tile 8,8: give three positive edges"),
            (["lab", *model, "--target", "lots"], "--target lots: size 'lots' is not a size"),
            (["lab", "--job", "ghost", "--data", images], "no job named ghost on lab"),
            (["lab", "--job", "fresh", "--data", images], "--job fresh: no run directory on lab"),
            (["lab", "--job", "untrained", "--data", images], "--job untrained: no trained model on lab yet"),
            (["lab", "--job", "predicted", "--data", images], "--job predicted: a predict job on lab, not a"),
            (["lab", "--job", "busy", "--data", images], "--job busy is still training on lab"),
            (
                ["lab", "--model", tmp_path / "runs" / "gone", "--data", images],
                f"--model {tmp_path}/runs/gone: does not exist on lab",
            ),
            (["lab", "--model", images, "--data", images], f"--model {images}: not a run directory on lab"),
            (
                ["lab", "--model", run, "--data", tmp_path / "scans"],
                f"--data {tmp_path}/scans: does not exist",
            ),
            (["lab", *model, "--labels", tmp_path / "labels"], f"--labels {tmp_path}/labels: does not exist"),
            (["lab", *model, "--name", "fresh"], "job fresh on lab is a training job; choose another --name"),
            (["lab", *model, "--name", "busy"], "job busy is already running on lab"),
        ]
        for arguments, message in cases:
            name = [] if "--name" in arguments else ["--name", "refused"]
            result = remote("predict", *arguments, *name, "--no-docker", inventory=inventory)
            assert result.returncode == 2 and message in one_line(result), (arguments, result.stderr)
        assert not (tmp_path / "remote" / "jobs" / "refused").exists()
        assert (
            sleeper.poll() is None and json.loads((tmp_path / "remote/jobs/busy/job.json").read_text())["pid"]
        )

        # A training job may not take a predict job's name either: both would write results/NAME.
        config = write_tiny_job(tmp_path / "tiny.yaml")
        started = remote(
            "start", "lab", "--config", config, "--name", "predicted", "--no-docker", inventory=inventory
        )
        assert started.returncode == 2 and "job predicted on lab is a predict job" in one_line(started)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_failed_predict_keeps_its_exit_code(inventory, tmp_path):
    """predict fails on the host (the run's files are not a model): the job ends with predict's exit code 2,
    evaluate never runs, and status says so."""
    run, images, labels = _fake_run(tmp_path / "run"), tmp_path / "images", tmp_path / "labels"
    images.mkdir()
    labels.mkdir()
    started = remote(
        "predict", "lab", "--model", run, "--data", images, "--labels", labels, "--name", "broken",
        "--no-docker", inventory=inventory,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert "started broken on lab (pid" in started.stdout and "predict then evaluate" in started.stdout
    followed = remote("logs", "lab", "broken", "--follow", inventory=inventory, timeout=300)
    # predict's one error, and nothing from evaluate (which would fail too, on a folder without masks).
    assert followed.stdout.count("bigmem-train: error:") == 1, followed.stdout
    assert "not a Keras model file" in followed.stdout and "evaluate" not in followed.stdout, followed.stdout
    status = _status(inventory, "broken")
    assert (status["command"], status["state"], status["exit_code"]) == ("predict", "failed", 2), status
    assert status["cases_done"] == 0 and "evaluation" not in status
    assert (
        "broken on lab: failed (exit code 2)" in remote("status", "lab", "broken", inventory=inventory).stdout
    )


@pytest.mark.slow
def test_predict_and_evaluate_with_a_remote_training_job(inventory, tmp_path):
    """Train a tiny job remotely, then predict its own synthetic images on the host with `--job` and
    evaluate them against its labels: status, and the masks fetched back with the images' geometry."""
    config = write_tiny_job(tmp_path / "tiny.yaml", epochs=2)
    started = remote(
        "start", "lab", "--config", config, "--name", "trained", "--no-docker", inventory=inventory
    )
    assert started.returncode == 0, started.stderr
    trained = remote("logs", "lab", "trained", "--follow", inventory=inventory, timeout=900)
    assert "PASS" in trained.stdout, trained.stdout[-3000:]
    dataset = next((tmp_path / "remote" / "jobs" / "trained" / "results").glob("synthetic-*"))
    images = sorted((dataset / "imagesTr").glob("*.nii.gz"))

    started = remote(
        "predict", "lab", "--job", "trained", "--data", dataset / "imagesTr", "--labels", dataset / "labelsTr",
        "--name", "p1", "--no-docker", inventory=inventory,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert "started p1 on lab (pid" in started.stdout and f"{dataset.parent}/trained" in started.stdout
    followed = remote("logs", "lab", "p1", "--follow", inventory=inventory, timeout=900)
    assert f"PREDICTED {len(images)} case(s)" in followed.stdout, followed.stdout[-3000:]
    assert "EVALUATED" in followed.stdout, followed.stdout[-3000:]

    status = _status(inventory, "p1")
    assert (status["command"], status["state"], status["exit_code"]) == ("predict", "finished", 0), status
    assert status["cases_done"] == status["cases_total"] == len(images) == 8
    assert status["evaluation"]["foreground"]["cases"] == 8 and status["peak_rss_bytes"] > 100 * 2**20
    text = remote("status", "lab", "p1", inventory=inventory).stdout
    assert "p1 on lab: finished" in text and "predicted 8/8 case(s)" in text, text
    assert "evaluation foreground: Dice mean" in text, text
    assert _status(inventory, "trained")["state"] == "finished"

    fetched = remote("fetch", "lab", "p1", "--to", tmp_path / "fetched", inventory=inventory)
    assert fetched.returncode == 0 and "8 mask(s), evaluation.json" in fetched.stdout, fetched.stderr
    out = tmp_path / "fetched" / "p1"
    for image_path in images:
        image, mask = nib.load(image_path), nib.load(out / image_path.name)
        assert mask.shape == image.shape[:3] and mask.get_data_dtype() == "uint8"
        assert (mask.affine == image.affine).all()
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert {case["case"] for case in evaluation["cases"]} == {path.name[: -len(".nii.gz")] for path in images}
    assert "PREDICTED" in (out / "job.log").read_text()
