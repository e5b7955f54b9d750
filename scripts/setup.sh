#!/usr/bin/env bash
# Set up bigmem-train on a Debian 12 machine (as root): system packages, then a virtual environment
# in .venv with the kit installed. Idempotent: rerunning it installs only what is missing.
#   bash scripts/setup.sh          the kit (train, plan, validate, report, render, remote)
#   bash scripts/setup.sh --test   the kit plus everything the test suite needs (Ansible, lint, lab tools)
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
[[ "${1:-}" == "--test" ]] && with_tests=1

packages=$(grep -v '^\s*#' scripts/apt-packages.txt | grep -v '^\s*$' | tr '\n' ' ')
missing=""
for package in $packages; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing="$missing $package"
done
if [[ -n "$missing" ]]; then
    echo "setup: installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

python=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
extras="ops"
[[ $with_tests == 1 ]] && extras="ops,test"
echo "setup: installing bigmem-train[$extras] into .venv"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extras]"
echo "setup: done ($(.venv/bin/bigmem-train --version))"
