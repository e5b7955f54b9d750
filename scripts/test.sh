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
started=$(date +%s)
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
pytest=(.venv/bin/python -m pytest -ra --durations=60)
# Ansible runs each module on this machine as a zip Python compiles afresh every time: the suite's
# processes keep that bytecode (tests/host/sitecustomize.py; about a fifth of a module's time).
export BIGMEM_ZIPIMPORT_CACHE=${BIGMEM_ZIPIMPORT_CACHE:-$HOME/.cache/bigmem-train/zipimport}
mkdir -p "$BIGMEM_ZIPIMPORT_CACHE"
export PYTHONPATH="$PWD/tests/host${PYTHONPATH:+:$PYTHONPATH}"

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
    date +%s >"$workdir/$name.end"
}

# Four streams, as cold runs on a 2-core EPYC without AVX-512 (CI's class) found their lengths:
# [lab] the lab VM (its disk, the Redfish reset, site.yml's converges and checks, the Slurm role): a
#   chain of waits on one emulation thread, so it gets the cores first (nice 0);
# [sched] the tests that mostly wait on other processes: the train role's two-worker plays (their
#   containers run at the daemon's priority; first, before the lab's demo-host plays want the same
#   lock), two TensorFlow workers and their heartbeat timeouts, the Slurm clusters' queues (nice 10; at
#   nice 5 beside main they slowed the lab's chain by a sixth, 12 minutes);
# [bmc] the BIOS role against the Redfish emulator alone (35 minutes), the unit tests, then the memory
#   guard's cgroup tests (their neighbours wait for the guard's verdict, not for a clock) (nice 10);
# [main] the rest: the image, training, the container, Fabric and Ansible tests: the most work, so it
#   comes next after the lab (nice 5).
# Containers run under the Docker daemon, at its nice level, not their stream's.
export BIGMEM_LAB_TIMEOUT_SCALE=${BIGMEM_LAB_TIMEOUT_SCALE:-2}
stream lab 0 tests/lab --ignore=tests/lab/test_bios_role.py &
lab=$!
waiting=(tests/remote/test_ansible_multi_worker.py tests/remote/test_multi_worker.py tests/remote/test_slurm.py)
stream sched 10 "${waiting[@]}" &
sched=$!
guard=tests/integration/test_memory_guard.py
stream bmc 10 tests/lab/test_bios_role.py tests/unit "$guard" &
bmc=$!
stream main 5 --ignore=tests/lab --ignore=tests/unit "${waiting[@]/#/--ignore=}" --ignore="$guard" &
main=$!
# CI stops a job at 90 minutes and keeps no log of it. Before that, interrupt the streams still running:
# pytest then prints what it was running, its summary and its slowest tests, so the log says where the
# time went. BIGMEM_TEST_DEADLINE_MIN=0 waits for them however long they take.
deadline=${BIGMEM_TEST_DEADLINE_MIN:-87}
kill_tree() {
    local child
    for child in $(pgrep -P "$1"); do kill_tree "$child"; done
    kill -TERM "$1" 2>/dev/null || true
}
watchdog=
if [ "$deadline" != 0 ]; then
    (
        left=$((deadline * 60 - ($(date +%s) - started)))
        sleep "$((left > 1 ? left : 1))"
        echo "test.sh: $deadline minutes since the start: interrupting the streams still running" >&2
        pkill -INT -f -- "--basetemp=$workdir/" || true
        # A stream waiting on its children (the lab's site.yml plays run in threads that pytest joins on
        # its way out) does not end on SIGINT: two minutes later, end its whole process tree.
        sleep 120
        for pid in $(pgrep -f -- "--basetemp=$workdir/"); do
            echo "test.sh: ending $(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-120) and its children" >&2
            kill_tree "$pid"
        done
    ) &
    watchdog=$!
fi
wait "$main" "$lab" "$sched" "$bmc"
if [ -n "$watchdog" ]; then kill "$watchdog" 2>/dev/null || true; fi

# The streams' lines interleave and a CI log keeps only its tail: each stream's outcome again, at the end.
status=0
for name in main lab sched bmc; do
    rc=$(cat "$workdir/$name.rc" 2>/dev/null || echo 1)
    grep -E '^(FAILED|ERROR) |^=+ .*[0-9.]+s( \([0-9:]+\))? =+$' "$workdir/$name.log" 2>/dev/null | cut -c1-400 | sed "s/^/test.sh: [$name] /"
    took=$(($(cat "$workdir/$name.end" 2>/dev/null || date +%s) - started))
    printf 'test.sh: %s stream exited %s, %d:%02d after the start\n' "$name" "$rc" $((took / 60)) $((took % 60))
    # 5 is pytest's "no tests collected" (e.g. a checkout without tests/lab): not a failure.
    if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then status=1; fi
done
exit "$status"
