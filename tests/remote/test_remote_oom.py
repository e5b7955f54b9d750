"""`bigmem-train remote status` names an OOM kill: a process-mode job started over SSH (the real sshd of
tests/fixtures/sshd.py) whose executable is a wrapper that puts it in a memory cgroup with a limit far
below its real peak, with the planner made wrong (a calibration file far too small) so preflight accepts
it. The kernel kills the job; status reads state.json (left `running`), the exit code, the cgroup's OOM
counter and the last memory sample in its one round trip and says "killed by the out-of-memory killer
at about X GiB (planned Y GiB)"."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import bigmem_train

from ..fixtures.cgroups import MemoryCgroup, why_not
from ..fixtures.common import write_tiny_job
from ..integration.conftest import bigmem
from ..integration.test_memory_guard import lying_calibration
from .test_remote import remote

MIB = 1024**2


@pytest.mark.slow
def test_status_names_an_oom_kill(sshd, tmp_path):
    reason = why_not(1)
    if reason:
        pytest.skip(f"cgroup v1: {reason}")
    config = write_tiny_job(tmp_path / "tiny.yaml", epochs=3, learns=True, results=Path("results"))
    cache = tmp_path / "cache"
    assert bigmem("plan", "-c", config, env={"BIGMEM_CACHE_DIR": str(cache)}).returncode == 0
    calibration = lying_calibration(tmp_path)
    cgroup = MemoryCgroup(1, f"bigmem-test-{os.getpid()}-remote", 300 * MIB)
    wrapper = tmp_path / "bigmem-train-limited"
    # The kit this test session imports (a checkout's src/ may come before the installed one).
    source = Path(bigmem_train.__file__).resolve().parents[1]
    wrapper.write_text(
        f"#!/bin/sh\necho $$ > {cgroup.folder}/cgroup.procs || exit 70\n"
        f"export BIGMEM_CALIBRATION={calibration} BIGMEM_CACHE_DIR={cache} PYTHONPATH={source}\n"
        f'exec {sys.executable} -m bigmem_train.cli "$@"\n'
    )
    wrapper.chmod(0o755)
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        f"lab ansible_host={sshd.host} ansible_port={sshd.port} ansible_user={sshd.user} "
        f"ansible_ssh_private_key_file={sshd.key_file} bigmem_train_remote_dir={tmp_path}/remote "
        f"bigmem_train_executable={wrapper}\n"
    )
    try:
        started = remote(
            "start", "lab", "--config", config, "--name", "oom", "--no-docker", inventory=inventory
        )
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + 300
        while True:
            result = remote("status", "lab", "oom", "--json", inventory=inventory)
            assert result.returncode == 0, result.stderr
            status = json.loads(result.stdout)
            status = status[0] if isinstance(status, list) else status
            if status["state"] != "running" or time.monotonic() > deadline:
                break
            time.sleep(2)
        text = remote("status", "lab", "oom", inventory=inventory).stdout
    finally:
        job = tmp_path / "remote" / "jobs" / "oom" / "job.json"
        if job.exists():
            try:
                os.killpg(json.loads(job.read_text())["pid"], 9)
            except ProcessLookupError:
                pass
        cgroup.remove()
    assert status["state"] == "killed" and status["exit_code"] == 137, json.dumps(status)
    assert status["run_state"] == "running"
    assert status["ending"]["cause"] == "oom", status
    assert "memory.oom_control oom_kill went from 0 to" in status["ending"]["evidence"]
    assert "killed by the out-of-memory killer at about" in text and "(planned 0.0" in text, text
    assert "oom on lab: killed (exit code 137)" in text
