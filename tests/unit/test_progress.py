"""Progress a person sees: figures on one line, a line at least every interval in a log even while one
step runs for long, and the first step announced as tracing."""

import io
import time
from pathlib import Path

from bigmem_train.train.monitor import rss_bytes
from bigmem_train.train.progress import ProgressReporter, ProgressState, format_duration


def test_the_status_line_shows_step_speed_memory_against_the_plan_and_time_left():
    state = ProgressState(epochs=3, steps_per_epoch=10, planned_peak_bytes=4 * 2**30)
    state.epoch, state.step = 1, 4
    state.step_seconds = [30.0, 2.0, 2.0, 4.0]  # the first (tracing) is left out of the speed
    state.validation_seconds = 5.0
    state.loss = 0.5
    line = state.line(time.monotonic(), bar_width=10)
    assert "epoch 2/3" in line and "step 4/10" in line
    assert "2.00 s/step" in line
    assert " of 4.00 planned (" in line and "mem " in line
    # 16 steps left at 2 s and two validations of 5 s.
    assert f"left {format_duration(16 * 2 + 2 * 5)}" in line
    assert "loss 0.5000" in line
    assert line.startswith("[###")  # 14 of 30 steps done


def test_a_step_running_long_is_reported_in_a_log_while_it_runs():
    state = ProgressState(epochs=1, steps_per_epoch=2, planned_peak_bytes=None)
    stream = io.StringIO()
    reporter = ProgressReporter(state, stream, interactive=False, log_interval=0.2)
    state.step_started = time.monotonic() - 10  # the first step, tracing for 10 s already
    reporter.start()
    time.sleep(1.3)
    reporter.stop()
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 3, lines
    assert all(line.startswith("bigmem-train: epoch 1/1  step 0/2") for line in lines)
    assert "tracing the first step for 1" in lines[0]
    assert "\r" not in stream.getvalue()


def test_a_terminal_gets_one_redrawn_line_and_events_above_it():
    state = ProgressState(epochs=1, steps_per_epoch=2, planned_peak_bytes=None)
    stream = io.StringIO()
    reporter = ProgressReporter(state, stream, interactive=True)
    reporter.report()
    reporter.say("bigmem-train: first step done in 3s")
    reporter.report()
    text = stream.getvalue()
    assert text.count("\r\033[K") == 3
    assert "bigmem-train: first step done in 3s\n" in text


def _kernel_vmrss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_resident_bytes_and_durations():
    # Against the kernel's own figure (VmRSS), and following 64 MiB this test touches.
    before = rss_bytes()
    assert abs(before - _kernel_vmrss()) < 4 * 2**20
    block = bytearray(64 * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    after = rss_bytes()
    assert abs(after - _kernel_vmrss()) < 4 * 2**20
    assert after - before > 60 * 2**20
    del block
    assert [format_duration(s) for s in (None, 5, 65, 3 * 3600 + 120)] == ["?", "5s", "1m05s", "3h02m"]
