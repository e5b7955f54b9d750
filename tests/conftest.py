"""Shared pytest setup. Service fixtures (Docker daemon, sshd, virtual lab) live in tests/fixtures/."""

import os

# Keep TensorFlow quiet and deterministic enough for tests.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

pytest_plugins = [
    "tests.fixtures.common",
    "tests.fixtures.docker_daemon",
    "tests.fixtures.lab",
    "tests.fixtures.slurm",
    "tests.fixtures.sshd",
]
