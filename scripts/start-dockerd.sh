#!/usr/bin/env bash
# Start a Docker daemon when none answers, for hosts without systemd (CI, test containers, labs).
#
# Idempotent: when `docker info` already answers (on DOCKER_HOST or the default socket), prints
# "dockerd: already running" and exits 0 without touching anything. Otherwise starts dockerd in
# the background, writes its PID to $BIGMEM_DOCKERD_PIDFILE, waits until it answers and prints
# "dockerd: started PID". Stop it later by that PID: kill "$(cat "$BIGMEM_DOCKERD_PIDFILE")".
#
# Environment (all optional):
#   BIGMEM_DOCKERD_PIDFILE   PID file (default /var/run/bigmem-dockerd.pid)
#   BIGMEM_DOCKERD_LOG       daemon log (default /var/log/bigmem-dockerd.log)
#   BIGMEM_DOCKERD_ARGS      extra dockerd flags, e.g. "--data-root /srv/docker"
#   BIGMEM_DOCKERD_TIMEOUT   seconds to wait for the daemon to answer (default 60)
set -euo pipefail

pidfile=${BIGMEM_DOCKERD_PIDFILE:-/var/run/bigmem-dockerd.pid}
logfile=${BIGMEM_DOCKERD_LOG:-/var/log/bigmem-dockerd.log}
timeout=${BIGMEM_DOCKERD_TIMEOUT:-60}
socket=/var/run/docker.sock

answers() { docker info >/dev/null 2>&1; }

if answers; then
    echo "dockerd: already running"
    exit 0
fi

command -v dockerd >/dev/null || { echo "dockerd: not installed (apt-get install docker.io)" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "dockerd: must run as root to start a daemon" >&2; exit 2; }

# Two starters at once (parallel test sessions) must not race: one waits for the other.
exec 9>"${pidfile}.lock"
flock -w "$timeout" 9 || { echo "dockerd: timed out waiting for ${pidfile}.lock" >&2; exit 1; }
if answers; then
    echo "dockerd: already running"
    exit 0
fi

# A stale socket or PID file from a killed daemon stops a new one from starting.
if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    rm -f "$pidfile"
fi
[ -S "$socket" ] && ! answers && rm -f "$socket"

start() {
    # shellcheck disable=SC2086  # BIGMEM_DOCKERD_ARGS is a list of flags
    setsid dockerd --host "unix://$socket" --pidfile "/var/run/docker.pid" "$@" \
        ${BIGMEM_DOCKERD_ARGS:-} >>"$logfile" 2>&1 </dev/null &
    local pid=$!
    echo "$pid" >"$pidfile"
    local waited=0
    while [ "$waited" -lt "$timeout" ]; do
        if answers; then
            echo "dockerd: started $pid (log $logfile)"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
        waited=$((waited + 1))
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    return 1
}

# First with Docker's default bridge network; where the kernel or sandbox refuses iptables or
# bridges (nested containers, microVMs), fall back to a daemon without them: builds and runs then
# use --network none or host, which is all the kit needs.
if start; then
    exit 0
fi
echo "dockerd: default start failed, retrying without iptables and bridge (see $logfile)" >&2
if start --iptables=false --ip6tables=false --bridge=none; then
    exit 0
fi
echo "dockerd: did not answer within ${timeout}s; last log lines:" >&2
tail -n 20 "$logfile" >&2
exit 1
