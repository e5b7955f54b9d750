#!/usr/bin/env bash
# Set up bigmem-train on a Debian 12 machine (as root): system packages, then a virtual environment in
# .venv with the kit. Idempotent: rerunning it installs only what is missing.
#   bash scripts/setup.sh          the kit: train, plan, validate, report, render (what `bigmem-train run` needs)
#   bash scripts/setup.sh --ops    the kit plus the operator's tools: Ansible, Fabric, the Docker engine, mmdebstrap
#                                  (docker/build-image.sh builds its Debian base with it where no registry answers)
#   bash scripts/setup.sh --test   all of that plus the test suite's tools (pytest, linters, QEMU, sshd, ...)
# Python packages the kit runs on come from docker/requirements.lock (hash-checked), the same versions the
# image installs: a lab's host and its image run the same TensorFlow, and the planner's constants fit both.
set -euo pipefail
cd "$(dirname "$0")/.."

sections="kit"
extras=""
case "${1:-}" in
    "") ;;
    --ops) sections="kit ops"; extras="ops" ;;
    --test) sections="kit ops test"; extras="ops test" ;;
    *) echo "setup: unknown option ${1} (use --ops or --test)" >&2; exit 2 ;;
esac

packages=$(awk -v wanted=" $sections " '
    /^\s*#/ || /^\s*$/ { next }
    /^\[.*\]$/ { section = substr($0, 2, length($0) - 2); next }
    index(wanted, " " section " ") { print $1 }' scripts/apt-packages.txt | tr '\n' ' ')
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
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
# The lock has tensorflow-cpu (the same TensorFlow and oneDNN, without GPU kernels); a full `tensorflow`
# left by an earlier setup would share its files, so it goes first.
if "${pip[@]}" show -q tensorflow >/dev/null 2>&1; then
    echo "setup: replacing tensorflow with the locked tensorflow-cpu"
    "${pip[@]}" uninstall -q -y tensorflow
fi
echo "setup: installing the locked runtime (docker/requirements.lock) into .venv"
"${pip[@]}" install -q --require-hashes --only-binary :all: -r docker/requirements.lock
"${pip[@]}" install -q --no-deps --no-build-isolation -e .
if [[ -n "$extras" ]]; then
    # The extras' own requirements, read from pyproject.toml (installing ".[ops]" would resolve the kit's
    # `tensorflow` requirement again, beside the locked tensorflow-cpu).
    mapfile -t requirements < <(.venv/bin/python - $extras <<'PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as file:
    optional = tomllib.load(file)["project"]["optional-dependencies"]
for extra in sys.argv[1:]:
    print("\n".join(optional[extra]))
PY
)
    echo "setup: installing the ${extras// /, } tools into .venv"
    "${pip[@]}" install -q "${requirements[@]}"
fi
"${pip[@]}" check >/dev/null 2>&1 || "${pip[@]}" check | grep -v "requires tensorflow" || true
echo "setup: done ($(.venv/bin/bigmem-train --version))"
