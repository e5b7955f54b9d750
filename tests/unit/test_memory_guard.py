"""Charge-aware measurement and the memory guard's decisions, on recorded cgroup v1/v2 layouts; the fresh read
at a step boundary and the Keras callback that stops model.fit there; how a run whose process is gone ended
(postmortem, validate), a guard stop killed on its way out included; which config changes resume a run the
guard stopped."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bigmem_train.config import config_from_dict
from bigmem_train.errors import BadInput
from bigmem_train.host import find_memory_cgroup, oom_kill_count
from bigmem_train.train.guard import MemoryGuard, Trip, stop_message
from bigmem_train.train.monitor import CSV_COLUMNS, MemoryProbe, MemorySample, MemorySampler
from bigmem_train.verdict.postmortem import after_memory_stop, container_id, diagnose, explain
from bigmem_train.verdict.rundir import (
    FINISHED,
    STOPPED,
    cgroup_record,
    prepare_run_dir,
    process_identity,
    read_memory_csv,
    read_state,
    set_state,
)
from tests.unit.test_run_dir import job  # one small job config, results folder and name as parameters

GIB = 1024**3
MIB = 1024**2


def write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2_layout(root: Path, current: int = 3 * GIB, inactive_file: int = GIB, oom_kill: int = 2) -> Path:
    """A container's cgroup v2 view: the limit sits on the parent slice, the run's cgroup has none."""
    return write(
        root,
        {
            "proc/self/cgroup": "0::/job.slice/run\n",
            "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
            "sys/fs/cgroup/job.slice/memory.max": f"{4 * GIB}\n",
            "sys/fs/cgroup/job.slice/run/memory.max": "max\n",
            "sys/fs/cgroup/job.slice/run/memory.current": f"{current}\n",
            "sys/fs/cgroup/job.slice/run/memory.peak": f"{current + MIB}\n",
            "sys/fs/cgroup/job.slice/run/memory.stat": f"anon {current - inactive_file}\nfile {inactive_file}\n"
            f"inactive_file {inactive_file}\n",
            "sys/fs/cgroup/job.slice/run/memory.events": f"low 0\nhigh 0\nmax 5\noom 3\noom_kill {oom_kill}\n",
        },
    )


def v1_layout(
    root: Path,
    usage: int = 3 * GIB,
    inactive_file: int = GIB,
    limit: int | str = 2**63 - 4096,
    hierarchical: int = 6 * GIB,
) -> Path:
    """A hybrid host (v2 mounted at unified/ without the memory controller), the run in a v1 docker cgroup."""
    return write(
        root,
        {
            "proc/self/cgroup": "9:name=systemd:/\n4:memory:/docker/abc\n0::/\n",
            "sys/fs/cgroup/unified/cgroup.controllers": "hugetlb\n",
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{limit}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{usage}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.max_usage_in_bytes": f"{usage + MIB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.stat": f"cache {inactive_file}\nrss {usage - inactive_file}\n"
            f"hierarchical_memory_limit {hierarchical}\n"
            f"total_inactive_file {inactive_file}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        },
    )


def test_v2_counters_limit_from_an_ancestor(tmp_path):
    cgroup = find_memory_cgroup(v2_layout(tmp_path))
    assert (cgroup.version, cgroup.path) == (2, "/job.slice/run")
    assert cgroup.limit_bytes() == 4 * GIB
    assert (cgroup.usage_bytes(), cgroup.peak_bytes()) == (3 * GIB, 3 * GIB + MIB)
    assert cgroup.inactive_file_bytes() == GIB
    assert cgroup.oom_kills() == 2 and cgroup.oom_counter_file.name == "memory.events"


def test_v1_counters_hybrid_layout(tmp_path):
    cgroup = find_memory_cgroup(v1_layout(tmp_path))
    assert (cgroup.version, cgroup.path) == (1, "/docker/abc")
    assert (
        cgroup.limit_bytes() == 6 * GIB
    )  # "no limit" of its own, the parent's through hierarchical_memory_limit
    assert (cgroup.usage_bytes(), cgroup.peak_bytes()) == (3 * GIB, 3 * GIB + MIB)
    assert cgroup.inactive_file_bytes() == GIB
    assert cgroup.oom_kills() == 1 and cgroup.oom_counter_file.name == "memory.oom_control"


def test_no_memory_cgroup(tmp_path):
    write(tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cgroup.controllers": "cpu\n"})
    assert find_memory_cgroup(tmp_path) is None
    assert oom_kill_count("pgfault 12\noom_kill 7\n") == 7 and oom_kill_count("") is None


def test_probe_judges_the_working_set_of_a_limited_cgroup(tmp_path):
    probe = MemoryProbe(find_memory_cgroup(v1_layout(tmp_path)))
    assert probe.measure == "cgroup v1 working set"
    probe.refresh_page_cache()
    sample = probe.read()
    assert sample.charged_bytes == 3 * GIB and sample.working_set_bytes == 2 * GIB
    assert sample.measured_bytes == 2 * GIB  # RSS of this test process is not what is judged
    assert sample.usable_bytes <= 6 * GIB


def test_probe_judges_rss_in_an_unlimited_cgroup(tmp_path):
    probe = MemoryProbe(find_memory_cgroup(v1_layout(tmp_path, hierarchical=2**63 - 4096)))
    assert probe.measure == "rss"
    sample = probe.read()
    assert sample.measured_bytes == sample.rss_bytes > 0
    assert sample.charged_bytes == 3 * GIB  # still recorded


def sample(measured: int, usable: int, measure: str = "cgroup v2 working set") -> MemorySample:
    return MemorySample(
        time.time(),
        rss_bytes=measured,
        charged_bytes=measured,
        working_set_bytes=measured,
        usable_bytes=usable,
        measure=measure,
    )


def test_guard_threshold_and_over_plan():
    guard = MemoryGuard(threshold=0.97, room=0.10, tolerance=0.10, planned_peak_bytes=10 * GIB, probe=None)
    assert guard.check(sample(int(9.6 * GIB), 10 * GIB)) is None
    assert guard.check(sample(int(9.71 * GIB), 10 * GIB)) == "threshold"
    # Over the plan by more than the tolerance with little room left...
    assert guard.check(sample(int(11.5 * GIB), 12 * GIB)) == "over_plan"
    # ... but not with room to spare, nor within the tolerance.
    assert guard.check(sample(int(11.5 * GIB), 20 * GIB)) is None
    assert guard.check(sample(int(10.9 * GIB), int(11.5 * GIB))) is None
    assert guard.check(sample(GIB, None)) is None


def test_guard_edges_trip_at_the_threshold_and_only_past_the_tolerance_and_the_room():
    # Figures a binary fraction represents exactly, so each edge is met to the byte.
    guard = MemoryGuard(threshold=0.5, room=0.5, tolerance=0.25, planned_peak_bytes=4 * GIB, probe=None)
    assert guard.check(sample(8 * GIB - 1, 16 * GIB)) is None
    assert guard.check(sample(8 * GIB, 16 * GIB)) == "threshold"  # at the threshold: tripped
    guard = MemoryGuard(threshold=0.99, room=0.5, tolerance=0.25, planned_peak_bytes=4 * GIB, probe=None)
    # Over the plan's 5 GiB (4 GiB + 25 %) with less than half of the 8 GiB usable left: tripped; at 5 GiB
    # exactly, within the tolerance: not.
    assert guard.check(sample(5 * GIB, 8 * GIB)) is None
    assert guard.check(sample(5 * GIB + 1, 8 * GIB)) == "over_plan"
    # Room: 6 GiB of 12 GiB usable leaves exactly half: not tripped, though 50 % over the plan; one byte
    # more leaves less than half: tripped.
    assert guard.check(sample(6 * GIB, 12 * GIB)) is None
    assert guard.check(sample(6 * GIB + 1, 12 * GIB)) == "over_plan"


def test_under_the_rss_measure_the_cgroups_charge_does_not_trip_the_guard():
    # A process without a memory limit is judged by its RSS: the cgroup's charge (page cache of other
    # processes, say) is no upper bound of it, and the guard neither trips on it nor reads afresh.
    guard = MemoryGuard(threshold=0.9, room=0.1, tolerance=0.1, planned_peak_bytes=None, probe=None)
    charged = MemorySample(
        time.time(),
        rss_bytes=GIB,
        charged_bytes=10 * GIB,
        working_set_bytes=10 * GIB,
        usable_bytes=10 * GIB,
        measure="rss",
    )
    guard.observe(charged)  # probe=None: a fresh read would raise
    assert guard.trip is None and guard.peak_measured_bytes == GIB
    # Its RSS past the threshold trips it on the sample itself: RSS has no stale page-cache figure to renew.
    guard.observe(replace(charged, rss_bytes=9 * GIB + 1))
    assert guard.trip is not None and guard.trip.reason == "threshold"
    assert guard.trip.sample.measured_bytes == 9 * GIB + 1


def test_guard_confirms_a_trip_with_fresh_page_cache_figures(tmp_path):
    # 3 GiB charged of a 3.1 GiB limit, but 1 GiB of it is inactive page cache the kernel drops first.
    cgroup = find_memory_cgroup(v2_layout(tmp_path, current=3 * GIB, inactive_file=GIB))
    write(tmp_path, {"sys/fs/cgroup/job.slice/memory.max": f"{int(3.1 * GIB)}\n"})
    probe = MemoryProbe(cgroup)
    guard = MemoryGuard(0.9, 0.1, 0.1, None, probe)
    guard.observe(
        probe.read()
    )  # no page-cache figure read yet: the whole 3 GiB charge, fresh figures say 2 GiB
    assert guard.trip is None
    # The kernel reclaimed the cache and the run took its place: the stale figure (1 GiB) would say 2 GiB.
    write(tmp_path, {"sys/fs/cgroup/job.slice/run/memory.stat": "inactive_file 0\n"})
    guard.observe(probe.read())
    assert guard.trip is not None and guard.trip.reason == "threshold"
    assert guard.trip.sample.measured_bytes == 3 * GIB


def test_stop_message_names_planned_measured_usable_and_the_fit():
    config = config_from_dict({"training": {"batch_size": 8}, "data": {"input_shape": [96, 96, 64]}})
    guard = MemoryGuard(0.97, 0.1, 0.1, 10 * GIB, None)
    trip = Trip("threshold", sample(int(11.7 * GIB), 12 * GIB, "cgroup v1 working set"))
    line = stop_message(trip, guard, config, epoch=2, step=4, run_name="big", batch=5, shape=None)
    assert "epoch 3, step 5" in line and "passed 97% of usable memory" in line
    assert "planned 10737418240 B (10.00 GiB)" in line and "(cgroup v1 working set)" in line
    assert "usable 12884901888 B (12.00 GiB)" in line
    assert "largest batch the measurement says fits at 96x96x64: 5" in line
    assert "--set training.batch_size=5 --run-name big" in line
    line = stop_message(trip, guard, config, 2, 4, "big", batch=0, shape=(64, 64, 48))
    assert "not even batch 1 fits" in line and "64x64x48" in line


def test_sampler_walks_page_tables_rarely_and_counts_its_cpu(tmp_path):
    seen = []
    sampler = MemorySampler(
        tmp_path / "memory.csv", interval=0.01, walk_interval=3600, listeners=[seen.append]
    )
    with sampler:
        time.sleep(0.5)
    assert sampler.samples >= 10 and len(seen) == sampler.samples
    assert sampler.walks == 2  # the first sample and the last one
    # It counts its own CPU time (every run reports it: metrics.json sampler_cpu_seconds); its budget is not
    # timed here: two walks of this test process's page tables, TensorFlow loaded, weigh on 40 samples as they
    # do not on a run's thousands, and a loaded machine stretches them further (2.8 ms a sample in a CI run).
    assert sampler.cpu_seconds > 0
    rows = read_memory_csv(tmp_path / "memory.csv")
    assert len(rows) == sampler.samples
    header = (tmp_path / "memory.csv").read_text().splitlines()[0].split(",")
    assert header[: len(CSV_COLUMNS)] == CSV_COLUMNS
    assert all(row["rss_bytes"] > 0 and row["usable_bytes"] > 0 for row in rows)
    # The interpreter's own libraries are mapped: a file-backed part, smaller than the whole.
    assert all(0 < row["rss_file_bytes"] < row["rss_bytes"] for row in rows)


def test_a_resumed_sampler_writes_under_the_columns_of_the_file_it_appends_to(tmp_path):
    path = tmp_path / "memory.csv"
    older = [name for name in CSV_COLUMNS if name != "rss_file_bytes"]  # a run started by an earlier version
    path.write_text(",".join(older) + "\n" + ",".join("1" for _ in older) + "\n")
    sampler = MemorySampler(path, interval=0.01, walk_interval=3600)
    with sampler:
        time.sleep(0.1)
    lines = path.read_text().splitlines()
    assert lines[0].split(",") == older and len(lines) == 2 + sampler.samples
    assert all(len(line.split(",")) == len(older) for line in lines)
    rows = read_memory_csv(path)
    assert rows[0]["rss_bytes"] == 1 and all(row["rss_bytes"] > 1000 for row in rows[1:])
    assert all("rss_file_bytes" not in row for row in rows)


# --- postmortem ------------------------------------------------------------------------------------


STATE = {
    "state": "running",
    "pid": 12345,
    "host_oom_kills": 4,
    "cgroup": {"version": 1, "path": "/docker/" + "ab" * 32, "oom_kills": 0, "limit_bytes": 2 * GIB},
}


def test_explain_weighs_the_evidence():
    oom = explain(
        STATE, measured_bytes=int(1.9 * GIB), planned_bytes=GIB, container_oom_killed=True, exit_code=137
    )
    assert oom.cause == "oom"
    assert oom.message == (
        "killed by the out-of-memory killer at about 1.90 GiB (planned 1.00 GiB; cgroup v1 limit 2.00 GiB)"
    )
    assert "OOMKilled" in oom.evidence
    counted = explain(STATE, measured_bytes=GIB, planned_bytes=GIB, cgroup_oom_kills=1)
    assert counted.cause == "oom" and "memory.oom_control oom_kill went from 0 to 1" in counted.evidence
    host = explain(STATE, measured_bytes=GIB, planned_bytes=GIB, host_oom_kills_now=5, exit_code=137)
    assert host.cause == "oom" and "/proc/vmstat" in host.evidence
    signal = explain(STATE, measured_bytes=GIB, planned_bytes=GIB, host_oom_kills_now=4, exit_code=137)
    assert (
        signal.cause == "killed"
        and "signal 9" in signal.message
        and "not by the out-of-memory" in signal.message
    )
    # A host-wide OOM kill while this run exited 1 on its own is not taken for its end.
    other = explain(STATE, measured_bytes=GIB, planned_bytes=None, host_oom_kills_now=9, exit_code=1)
    assert other.cause == "unknown" and "no plan recorded" in other.message
    assert explain(STATE, measured_bytes=None, planned_bytes=GIB, rebooted=True).cause == "rebooted"
    assert container_id(STATE) == "ab" * 32
    # A private cgroup namespace (Docker's default on cgroup v2) shows "/": the id recorded from the mounts.
    private = {**STATE, "cgroup": {**STATE["cgroup"], "path": "/"}}
    assert container_id(private) is None and container_id({**private, "container_id": "cd" * 32}) == "cd" * 32


def test_diagnose_tells_a_gone_process_from_a_live_one(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"peak_bytes": GIB}))
    live = {**process_identity(), "state": "running"}
    assert diagnose(tmp_path, live) is None
    child = subprocess.Popen(["true"])
    child.wait()
    gone = {**live, "pid": child.pid, "host_oom_kills": None}
    gone.pop("cgroup", None)
    ending = diagnose(tmp_path, gone)
    assert ending is not None and ending.cause == "unknown" and "planned 1.00 GiB" in ending.message
    # The same PID reused by another process is still "gone" (its start time differs).
    assert diagnose(tmp_path, {**live, "start_ticks": live["start_ticks"] - 1}) is not None
    assert diagnose(tmp_path, {**live, "state": FINISHED}) is None


def test_process_identity_records_what_postmortem_needs():
    identity = process_identity()
    assert identity["pid"] == os.getpid() and identity["start_ticks"] > 0
    assert identity["boot_id"] and identity["pid_namespace"].startswith("pid:")


# --- resuming a run the guard stopped --------------------------------------------------------------


def test_a_run_the_guard_stopped_resumes_with_a_smaller_batch_only(tmp_path):
    run_dir, resuming = prepare_run_dir(job(tmp_path))
    (run_dir / "backup").mkdir()
    with pytest.raises(BadInput, match="different config"):
        prepare_run_dir(job(tmp_path, batch_size=2))  # not stopped by the guard: refused as before
    set_state(run_dir, STOPPED, stopped="memory", message="memory guard stopped the run")
    with pytest.raises(
        BadInput, match="may change only training.batch_size, data.input_shape, footprint.tolerance"
    ):
        prepare_run_dir(job(tmp_path, batch_size=2, epochs=3))
    again, resuming = prepare_run_dir(job(tmp_path, batch_size=2))
    assert again == run_dir and resuming
    state = read_state(run_dir)
    assert state["state"] == "running" and "stopped" not in state and state["pid"] == os.getpid()


def test_remote_status_weighs_what_its_round_trip_read():
    from bigmem_train.ops.status import _ending

    header = ",".join(CSV_COLUMNS)
    values = {
        "time_unix": 1.0,
        "elapsed_s": 1.0,
        "rss_bytes": 3 * GIB,
        "rss_file_bytes": GIB // 4,
        "anon_hugepages_bytes": 0,
        "charged_bytes": 2 * GIB,
        "working_set_bytes": int(1.9 * GIB),
        "usable_bytes": 2 * GIB,
    }
    last = ",".join(str(values[name]) for name in CSV_COLUMNS)
    docker = _ending(
        STATE,
        {"container": "true 137", "memory_last": f"{header}\n{last}", "plan_peak": str(GIB), "host_oom": "4"},
        exit_code=None,
    )
    assert docker.cause == "oom" and "OOMKilled" in docker.evidence
    assert docker.message.startswith("killed by the out-of-memory killer at about 1.90 GiB (planned 1.00 GiB")
    process = _ending(
        {**STATE, "cgroup": {**STATE["cgroup"], "limit_bytes": None}},
        {"memory_last": f"{header}\n{last}", "cgroup_oom": "1", "host_oom": "5"},
        exit_code=137,
    )
    assert (
        process.cause == "oom" and "at about 3.00 GiB" in process.message
    )  # RSS: no limit, no working set judged
    assert "no plan recorded" in process.message
    plain = _ending(STATE, {"container": "false 137", "host_oom": "4", "cgroup_oom": ""}, exit_code=None)
    assert plain.cause == "killed"


@pytest.fixture
def recorded_planner(recorded_tables):
    """The planner on recorded layer tables and fixed constants (no TensorFlow)."""
    from bigmem_train.memory import constants, layers, sizing

    return lambda config, batch, shape: sizing._peak(
        config, layers.layer_table(config), constants.load_calibration(), batch, shape
    )


def test_the_largest_fit_sheds_what_was_measured_over_the_guards_share(recorded_planner):
    from bigmem_train.train.guard import largest_fitting_job

    config = config_from_dict({"data": {"input_shape": [128, 128, 128]}, "training": {"batch_size": 8}})
    shape = (128, 128, 128)
    planned = recorded_planner(config, 8, shape)
    usable = planned  # the plan just fitted, but the run measured 1 GiB more than planned
    measured = planned + GIB
    batch, fitting_shape = largest_fitting_job(config, planned, measured, usable)
    allowed = usable * 0.97 * 0.9
    shift = measured - planned
    assert 1 <= batch < 8 and fitting_shape is None
    assert recorded_planner(config, batch, shape) + shift <= allowed
    assert recorded_planner(config, batch + 1, shape) + shift > allowed  # the largest
    # Far over: not even batch 1 at this shape; the largest shape at batch 1 that sheds enough.
    shift = int(allowed - recorded_planner(config, 1, shape)) + 64 * MIB
    batch, fitting_shape = largest_fitting_job(config, planned, planned + shift, usable)
    assert batch == 0 and fitting_shape is not None and fitting_shape != shape
    assert all(edge <= limit for edge, limit in zip(fitting_shape, shape))
    assert recorded_planner(config, 1, fitting_shape) + shift <= allowed
    # The largest at batch 1: one level's step (16 voxels at depth 4) more on any axis does not fit.
    for axis in range(3):
        grown = list(fitting_shape)
        grown[axis] += 16
        assert grown[axis] > shape[axis] or recorded_planner(config, 1, tuple(grown)) + shift > allowed, axis
    assert largest_fitting_job(config, None, measured, usable) == (0, None)


def test_the_suggestion_is_always_a_smaller_job_and_batch_one_keeps_the_shape(recorded_planner):
    from bigmem_train.train.guard import largest_fitting_job

    config = config_from_dict({"data": {"input_shape": [128, 128, 128]}, "training": {"batch_size": 8}})
    shape = (128, 128, 128)
    planned = recorded_planner(config, 8, shape)
    usable = 2 * planned
    allowed = int(usable * 0.97 * 0.9)  # the guard's share (threshold 0.97) less the safety margin (10 %)
    # Tripped with nothing measured above the share (e.g. by growth): the plan's batch would fit, but the
    # suggestion must be a smaller job than the one that tripped.
    assert largest_fitting_job(config, planned, allowed - 1, usable) == (7, None)
    # Batch 1 fits exactly where batch 2 does not: batch 1 at the same shape, no smaller shape offered.
    one, two = recorded_planner(config, 1, shape), recorded_planner(config, 2, shape)
    shift = planned - (one + two) // 2  # the budget, planned - shift, between the two
    assert largest_fitting_job(config, planned, allowed + shift, usable) == (1, None)
    # Budget exactly 0 and missing figures: nothing can be said.
    assert largest_fitting_job(config, planned, allowed + planned, usable) == (0, None)
    assert largest_fitting_job(config, planned, 0, usable) == (0, None)
    assert largest_fitting_job(config, planned, allowed + 1, 0) == (0, None)


def test_a_guard_stop_killed_on_its_way_out_is_said_whole(tmp_path):
    from bigmem_train.verdict.postmortem import after_memory_stop

    (tmp_path / "plan.json").write_text(json.dumps({"peak_bytes": GIB}))
    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    child = subprocess.Popen(["true"])
    child.wait()
    stopped = {
        **process_identity(),
        "pid": child.pid,
        "state": "stopped",
        "stopped": "memory",
        "leaving": True,
        "message": "memory guard stopped the run",
        "cgroup": {"version": 1, "oom_kills": 0, "oom_counter_file": str(counter), "limit_bytes": GIB},
    }
    ending = after_memory_stop(tmp_path, stopped)
    assert ending.cause == "oom" and "oom_kill went from 0 to 1" in ending.evidence
    # Left cleanly (everything written), or still on its way out: the stop alone.
    assert after_memory_stop(tmp_path, {**stopped, "leaving": False}) is None
    assert after_memory_stop(tmp_path, {**stopped, "pid": os.getpid(), **process_identity()}) is None


# --- the guard at a step boundary, the Keras callback, and a stop killed on its way out ----------------


class StandInProbe:
    """A memory probe that reads the given measurements in turn (the last one from then on), counting reads."""

    def __init__(self, *measured: int, usable: int = 10 * GIB, measure: str = "rss"):
        self.measured, self.usable, self.measure = list(measured), usable, measure
        self.reads = 0
        self.refreshes = 0

    def refresh_page_cache(self) -> None:
        self.refreshes += 1

    def read(self) -> MemorySample:
        value = self.measured[min(self.reads, len(self.measured) - 1)]
        self.reads += 1
        return sample(value, self.usable, self.measure)


def test_a_step_boundary_reads_memory_afresh_before_deciding():
    # The sampler last saw 5 GiB of 10; memory rose to 9.8 GiB (over 97 %) before its next sample.
    probe = StandInProbe(int(9.8 * GIB))
    guard = MemoryGuard(0.97, 0.1, 0.1, None, probe)
    guard.observe(sample(5 * GIB, 10 * GIB, "rss"))
    assert guard.trip is None and probe.reads == 0
    trip = guard.look()
    assert probe.reads == 1, "the step boundary decided without reading memory afresh"
    assert trip is not None and trip.reason == "threshold" and trip.sample.measured_bytes == int(9.8 * GIB)
    # Below the threshold: a fresh look, no trip.
    calm = MemoryGuard(0.97, 0.1, 0.1, None, StandInProbe(5 * GIB))
    assert calm.look() is None and calm.probe.reads == 1


class _Backup:
    """Stands in for keras.callbacks.BackupAndRestore: records what the guard asks it to save."""

    def __init__(self):
        self.saved: list[tuple[int, int]] = []
        self._current_epoch = None
        self._last_batch_seen = None

    def _save_model(self):
        self.saved.append((self._current_epoch, self._last_batch_seen))


def test_the_guard_callback_stops_model_fit_at_the_first_step_after_a_trip(tmp_path):
    import keras
    import numpy as np

    from bigmem_train.train.guard import MemoryStopped, guard_callback

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    set_state(run_dir, "running")
    config = config_from_dict({})
    # Step boundaries 0 and 1 read 1 GiB of 10; boundary 2 reads 9.8 GiB: over 97 %.
    probe = StandInProbe(GIB, GIB, int(9.8 * GIB))
    guard = MemoryGuard(0.97, 0.1, 0.1, None, probe)
    backup = _Backup()
    steps_ended = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_ended.append(batch)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    features, targets = np.zeros((40, 4), "float32"), np.zeros((40, 1), "float32")
    callbacks = [Steps(), guard_callback(guard, backup, config, run_dir)]
    with pytest.raises(MemoryStopped) as stopped:
        model.fit(features, targets, batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
    assert steps_ended == [0, 1, 2], "training went on past the step boundary after the trip"
    assert backup.saved == [(0, 2)]
    record = stopped.value.record
    assert (record["stopped"], record["reason"], record["epoch"], record["step"]) == (
        "memory",
        "threshold",
        0,
        2,
    )
    assert record["measured_bytes"] == int(9.8 * GIB) and record["usable_bytes"] == 10 * GIB
    assert "memory guard stopped the run at epoch 1, step 3" in str(stopped.value)
    state = read_state(run_dir)
    assert state["state"] == STOPPED and state["stopped"] == "memory" and state["leaving"] is True
    assert state["step"] == 2 and state["message"] == str(stopped.value)

    # During an epoch's validation the guard stops too, and the epoch in progress is the one to run again.
    guard = MemoryGuard(0.97, 0.1, 0.1, None, StandInProbe(int(9.9 * GIB)))
    backup = _Backup()
    callback = guard_callback(guard, backup, config, run_dir)
    callback.on_epoch_begin(1)
    with pytest.raises(MemoryStopped) as stopped:
        callback.on_test_batch_end(5)
    assert (stopped.value.record["epoch"], stopped.value.record["step"]) == (1, 5) and backup.saved == [
        (1, 5)
    ]
    # No trip: nothing is saved, nothing raised.
    quiet = guard_callback(MemoryGuard(0.97, 0.1, 0.1, None, StandInProbe(GIB)), _Backup(), config, run_dir)
    quiet.on_train_batch_end(0)
    quiet.on_test_batch_end(0)


def _gone_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_v2_cgroups_oom_kills_are_counted_and_named_from_memory_events(tmp_path):
    root = v2_layout(tmp_path / "host", oom_kill=2)
    cgroup = find_memory_cgroup(root)
    recorded = cgroup_record(cgroup)
    assert recorded["oom_kills"] == 2 and recorded["oom_counter_file"].endswith(
        "/job.slice/run/memory.events"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "plan.json").write_text(json.dumps({"peak_bytes": 3 * GIB}))
    stopped = {
        **process_identity(),
        "pid": _gone_pid(),
        "host_oom_kills": None,
        "state": STOPPED,
        "stopped": "memory",
        "leaving": True,
        "cgroup": recorded,
    }
    # The OOM killer killed the process on its way out: v2 counts it in memory.events (memory.oom_control
    # is v1's file; a v2 folder has none).
    write(root, {"sys/fs/cgroup/job.slice/run/memory.events": "low 0\nhigh 0\nmax 9\noom 4\noom_kill 3\n"})
    ending = after_memory_stop(run_dir, stopped)
    assert ending is not None and ending.cause == "oom"
    assert ending.evidence == "cgroup v2 memory.events oom_kill went from 2 to 3 during the run"


def test_a_v2_counter_is_found_under_the_hosts_cgroup_mount_when_the_recorded_file_is_not_here(
    tmp_path, monkeypatch
):
    # Recorded inside a container (its own mount namespace); read later from the host, where the run's cgroup
    # is /sys/fs/cgroup/<path>: v2 keeps its counter in memory.events there.
    from bigmem_train.verdict import postmortem

    host = tmp_path / "host"
    write(host, {"sys/fs/cgroup/job.slice/run/memory.events": "low 0\nhigh 0\nmax 9\noom 4\noom_kill 3\n"})

    def host_view(*parts):
        path = Path(*parts)
        return host / str(path).lstrip("/") if str(path).startswith("/sys/fs/cgroup") else path

    monkeypatch.setattr(postmortem, "Path", host_view)
    state = {
        "cgroup": {
            "version": 2,
            "path": "/job.slice/run",
            "oom_counter_file": str(tmp_path / "container-only" / "memory.events"),
            "oom_kills": 2,
        }
    }
    assert postmortem._cgroup_oom_kills_here(state) == 3


HISTORY = "epoch,dice,hard_dice,loss,val_dice,val_hard_dice,val_loss\n0,0.2,0.2,1.0,0.3,0.3,1.0\n"


def test_validate_says_the_stop_and_the_kill_on_its_way_out(tmp_path):
    from bigmem_train.config import load_config
    from bigmem_train.verdict.validate import evaluate

    root = v2_layout(tmp_path / "host", oom_kill=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(None, {"training.epochs": 3}).to_yaml())
    (run_dir / "history.csv").write_text(HISTORY)
    (run_dir / "plan.json").write_text(json.dumps({"peak_bytes": 3 * GIB}))
    values = dict.fromkeys(CSV_COLUMNS, 0)
    values.update(time_unix=1.0, elapsed_s=1.0, rss_bytes=4 * GIB, charged_bytes=4 * GIB)
    values.update(working_set_bytes=int(3.5 * GIB), usable_bytes=4 * GIB)
    (run_dir / "memory.csv").write_text(
        ",".join(CSV_COLUMNS) + "\n" + ",".join(str(values[name]) for name in CSV_COLUMNS) + "\n"
    )
    stop = "memory guard stopped the run at epoch 2, step 7"
    state = {
        **process_identity(),
        "pid": _gone_pid(),
        "host_oom_kills": None,
        "stopped": "memory",
        "leaving": True,
        "message": stop,
        "cgroup": cgroup_record(find_memory_cgroup(root)),
    }
    set_state(run_dir, STOPPED, **state)
    write(root, {"sys/fs/cgroup/job.slice/run/memory.events": "oom 4\noom_kill 3\n"})
    finished = {criterion.name: criterion for criterion in evaluate(run_dir).criteria}["finished"]
    assert not finished.passed
    assert finished.detail == (
        f"stopped by the memory guard, checkpoint saved: {stop}; then, on its way out, killed by the "
        "out-of-memory killer at about 3.50 GiB (planned 3.00 GiB; cgroup v2 limit 4.00 GiB) "
        "(cgroup v2 memory.events oom_kill went from 2 to 3 during the run)"
    )
    # Left cleanly: the stop alone.
    set_state(run_dir, STOPPED, leaving=False)
    finished = {criterion.name: criterion for criterion in evaluate(run_dir).criteria}["finished"]
    assert finished.detail == f"stopped by the memory guard, checkpoint saved: {stop}"
