"""Helpers for the remote and multi-worker tests: a tiny job config and an inventory for the test sshd."""

from pathlib import Path

import pytest

from tests.fixtures.common import write_tiny_job


@pytest.fixture
def tiny_job(tmp_path) -> Path:
    return write_tiny_job(tmp_path / "tiny.yaml")
