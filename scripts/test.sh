#!/usr/bin/env bash
# Set up everything the test suite needs and run it (as root on Debian 12).
# The suite starts the services it needs itself (Docker daemon, sshd, the virtual lab, the Redfish
# emulator) and stops them by PID when it ends. Extra arguments go to pytest, e.g. -m "not lab".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -ra --durations=40 "$@"
