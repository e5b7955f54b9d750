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


def pytest_configure(config):
    """scripts/test.sh runs its streams in the background, where bash leaves SIGINT ignored, and interrupts
    those still running at its deadline with SIGINT, so that each prints its summary and runs its fixtures'
    teardown: take SIGINT back as Python's KeyboardInterrupt."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
