#!/usr/bin/env bash
# Fill the wheelhouse `.whl/` (repository root) with the wheels docker/requirements.lock pins, for
# the image's platform (CPython 3.11, manylinux x86_64, glibc <= 2.36 = Debian 12), checked against
# the lock's hashes. Run on a host with PyPI (or a mirror: PIP_INDEX_URL); the image build then needs
# no network. Wheels already there are kept; wheels the lock no longer names are removed.
#
# Usage: docker/build-wheelhouse.sh [--refresh] [DIR]   (default DIR: .whl in the repository root)
#   --refresh  check with the index even when the wheelhouse's stamp says it matches the lock
set -euo pipefail

refresh=0
if [ "${1:-}" = --refresh ]; then
    refresh=1
    shift
fi
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
wheelhouse=${1:-$repo/.whl}
lock=$here/requirements.lock
python=${PYTHON:-python3}
mkdir -p "$wheelhouse"

# A stamp of the lock the wheelhouse was last filled from: nothing to do while it is current.
stamp="$wheelhouse/.requirements.lock.sha256"
lock_sha256=$(sha256sum "$lock" | cut -d' ' -f1)
if [ "$refresh" -eq 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$lock_sha256" ]; then
    echo "wheelhouse $wheelhouse is current for docker/requirements.lock"
    exit 0
fi

# --platform etc. pick the image's wheels whatever this host runs; pip checks every file against
# the lock's hashes (--require-hashes is implied by them) and skips files already downloaded.
platforms=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
for glibc_minor in $(seq 36 -1 5); do
    platforms+=(--platform "manylinux_2_${glibc_minor}_x86_64")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none "${platforms[@]}" \
    --dest "$wheelhouse" -r "$lock"

# Drop wheels no longer in the lock, so the build context stays as small as the lock.
"$python" - "$wheelhouse" "$lock" <<'EOF'
import hashlib
import re
import sys
from pathlib import Path

wheelhouse, lock = Path(sys.argv[1]), Path(sys.argv[2])
locked = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", lock.read_text()))
kept = 0
for wheel in sorted(wheelhouse.glob("*.whl")):
    digest = hashlib.sha256()
    with wheel.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() in locked:
        kept += 1
    else:
        print(f"removing {wheel.name} (not in the lock)")
        wheel.unlink()
total = sum(wheel.stat().st_size for wheel in wheelhouse.glob("*.whl"))
print(f"wheelhouse {wheelhouse}: {kept} wheels, {total / 2**20:.0f} MiB")
EOF
echo "$lock_sha256" >"$stamp"
