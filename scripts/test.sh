#!/usr/bin/env bash
# Set up everything the test suite needs and run it (as root on Debian 12).
# The suite starts the services it needs itself (Docker daemon, sshd, the virtual lab, the Redfish
# emulator) and stops them by PID when it ends. Extra arguments go to pytest, e.g. -m "not lab", and
# run it as one session.
#
# Without arguments the suite runs as four pytest sessions side by side, each line prefixed with its
# stream (below: [lab], [sched], [bmc], [main]). They share one Docker daemon, started here and
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

# Four streams, as cold runs on a 2-core EPYC without AVX-512 (CI's class) found their lengths:
# [lab] the lab VM (its disk, the Redfish reset, site.yml's converges and checks, the Slurm role): a
#   chain of waits on one emulation thread, so it gets the cores first (nice 0);
# [sched] the tests that mostly wait on other processes: two TensorFlow workers and their heartbeat
#   timeouts, the Slurm clusters' queues (nice 5);
# [bmc] the BIOS role against the Redfish emulator alone (40 minutes), then the unit tests (nice 10);
# [main] the rest: the image, training, the container, Fabric and Ansible tests (nice 10).
# Containers run under the Docker daemon, at its nice level, not their stream's.
export BIGMEM_LAB_TIMEOUT_SCALE=${BIGMEM_LAB_TIMEOUT_SCALE:-2}
stream lab 0 tests/lab --ignore=tests/lab/test_bios_role.py &
lab=$!
stream sched 5 tests/remote/test_multi_worker.py tests/remote/test_slurm.py &
sched=$!
stream bmc 10 tests/lab/test_bios_role.py tests/unit &
bmc=$!
stream main 10 --ignore=tests/lab --ignore=tests/unit --ignore=tests/remote/test_multi_worker.py \
    --ignore=tests/remote/test_slurm.py &
main=$!
wait "$main" "$lab" "$sched" "$bmc"

# The streams' lines interleave and a CI log keeps only its tail: each stream's outcome again, at the end.
status=0
for name in main lab sched bmc; do
    rc=$(cat "$workdir/$name.rc" 2>/dev/null || echo 1)
    grep -E '^(FAILED|ERROR) |^=+ .*[0-9.]+s( \([0-9:]+\))? =+$' "$workdir/$name.log" 2>/dev/null | cut -c1-400 | sed "s/^/test.sh: [$name] /"
    echo "test.sh: $name stream exited $rc"
    # 5 is pytest's "no tests collected" (e.g. a checkout without tests/lab): not a failure.
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then status=1; fi
done
exit "$status"
