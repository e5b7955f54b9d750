#!/usr/bin/env bash
# Set up everything the test suite needs and run it (as root on Debian 12).
# The suite starts the services it needs itself (Docker daemon, sshd, the virtual lab, the Redfish
# emulator) and stops them by PID when it ends. Extra arguments go to pytest, e.g. -m "not lab", and
# run it as one session.
#
# Without arguments the suite runs as three pytest sessions side by side, each line prefixed with its
# stream: [lab] is tests/lab (the QEMU VM, one emulation thread, much of its time spent waiting on the
# VM's boots, apt and SSH) but the BIOS role's tests, [bmc] those (the Redfish emulator alone) and then
# tests/unit, [main] everything else. They share one Docker daemon, started here and
# stopped by PID at the end, and one image (tests/fixtures/docker_daemon.py builds it under a lock).
# BIGMEM_TEST_PARALLEL=0 runs the whole suite as one session instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
pytest=(.venv/bin/python -m pytest -ra --durations=60)

if [ "$#" -gt 0 ] || [ "${BIGMEM_TEST_PARALLEL:-1}" = 0 ]; then
    exec "${pytest[@]}" "$@"
fi

started_dockerd=
workdir=$(mktemp -d /tmp/bigmem-tests.XXXXXX)
cleanup() {
    if [ -n "$started_dockerd" ] && kill -0 "$started_dockerd" 2>/dev/null; then
        kill "$started_dockerd"
        for _ in $(seq 60); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 1; done
    fi
    rm -rf "$workdir"
}
trap cleanup EXIT
if out=$(bash scripts/start-dockerd.sh); then
    echo "$out"
    # "dockerd: started PID (log FILE)": the PID alone.
    case $out in "dockerd: started "*) started_dockerd=$(sed -n 's/^dockerd: started \([0-9]*\).*/\1/p' <<<"$out") ;; esac
else
    echo "$out"
    echo "test.sh: could not start a Docker daemon; the Docker tests will say why" >&2
fi

# One stream: pytest at a nice level, with its own temporary folder, every line prefixed, its exit code kept.
stream() {
    local name=$1 niceness=$2
    shift 2
    set +e +o pipefail
    nice -n "$niceness" "${pytest[@]}" --basetemp="$workdir/$name" "$@" 2>&1 | tee "$workdir/$name.log" | sed -u "s/^/[$name] /"
    echo "${PIPESTATUS[0]}" >"$workdir/$name.rc"
}

# The lab is the longer stream and its VM emulates on one thread: it gets the cores first (the main
# stream runs at nice 10; containers it starts run under the Docker daemon, unchanged), and its waits get
# room for the time the other streams still take from it. The BIOS role's tests need only the Redfish
# emulator, not the VM: they run as a third stream [bmc] from the start, not ahead of the VM's (on a 2-core
# machine without AVX-512 they took 28 minutes of the lab stream's 95), and the unit tests after them, at
# the main stream's nice level: [main] (the image, training, the remote tests) was the longest stream, 75
# minutes cold on that machine, with the BIOS stream done after 40.
export BIGMEM_LAB_TIMEOUT_SCALE=${BIGMEM_LAB_TIMEOUT_SCALE:-2}
stream lab 0 tests/lab --ignore=tests/lab/test_bios_role.py &
lab=$!
stream bmc 10 tests/lab/test_bios_role.py tests/unit &
bmc=$!
stream main 10 --ignore=tests/lab --ignore=tests/unit &
main=$!
wait "$main" "$lab" "$bmc"

# The streams' lines interleave and a CI log keeps only its tail: each stream's outcome again, at the end.
status=0
for name in main lab bmc; do
    rc=$(cat "$workdir/$name.rc" 2>/dev/null || echo 1)
    grep -E '^(FAILED|ERROR) |^=+ .*[0-9.]+s( \([0-9:]+\))? =+$' "$workdir/$name.log" 2>/dev/null | cut -c1-400 | sed "s/^/test.sh: [$name] /"
    echo "test.sh: $name stream exited $rc"
    # 5 is pytest's "no tests collected" (e.g. a checkout without tests/lab): not a failure.
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then status=1; fi
done
exit "$status"
