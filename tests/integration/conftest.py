"""Helpers for tests that run the real `bigmem-train` CLI in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import write_tiny_job


def bigmem(*args, cwd=None, timeout=900, env=None):
    """Run the CLI as a user would; returns the CompletedProcess (text)."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "bigmem_train.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )


@pytest.fixture
def tiny_job(tmp_path) -> Path:
    """Write a tiny synthetic job config (epochs adjustable via --set)."""
    return write_tiny_job(tmp_path / "tiny.yaml", epochs=6, learns=True, results=tmp_path / "results")
