"""scripts/start-dockerd.sh: a second start leaves the running daemon alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker


def test_start_dockerd_is_idempotent(docker_daemon: str, repo_root: Path) -> None:
    result = subprocess.run(
        ["bash", str(repo_root / "scripts" / "start-dockerd.sh")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "dockerd: already running"
    assert subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
