"""What a person watching a run sees: progress with seconds per step, memory against the plan, time left.

In a terminal, one line redrawn every second (a bar, the step, s/step, memory, time left, the loss);
in a log (``docker run -d``, Ansible, a pipe) a full line at least every ``log_interval`` seconds and
after each epoch. Both come from a thread, so a step that takes minutes (the study's tile, or the first
step, which traces the graph) is still reported while it runs.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import TextIO

from bigmem_train.sizes import GIB
from bigmem_train.train.monitor import rss_bytes


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressState:
    """The figures of a run in progress, updated by the Keras callback and read by the reporting thread."""

    def __init__(self, epochs: int, steps_per_epoch: int, planned_peak_bytes: int | None):
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.planned_peak_bytes = planned_peak_bytes
        self.epoch = 0
        self.step = 0  # steps finished in this epoch
        self.step_seconds: list[float] = []  # this session's steps, the first (tracing) included
        self.step_started: float | None = None
        self.validation_seconds: float | None = None
        self.validating_since: float | None = None
        self.loss: float | None = None

    def seconds_per_step(self) -> float | None:
        timed = self.step_seconds[1:] if len(self.step_seconds) > 1 else self.step_seconds
        return statistics.median(timed[-50:]) if timed else None

    def time_left(self) -> float | None:
        per_step = self.seconds_per_step()
        if per_step is None:
            return None
        remaining_steps = (self.epochs - self.epoch) * self.steps_per_epoch - self.step
        remaining_validations = self.epochs - self.epoch
        return remaining_steps * per_step + remaining_validations * (self.validation_seconds or 0.0)

    def line(self, now: float, bar_width: int = 0) -> str:
        """One status line: where the run is, how fast, how much memory against the plan, how long left."""
        done = self.epoch * self.steps_per_epoch + self.step
        total = self.epochs * self.steps_per_epoch
        parts = [
            f"epoch {min(self.epoch + 1, self.epochs)}/{self.epochs}",
            f"step {self.step}/{self.steps_per_epoch}",
        ]
        if bar_width:
            filled = int(bar_width * done / max(1, total))
            parts.insert(0, "[" + "#" * filled + "." * (bar_width - filled) + "]")
        per_step = self.seconds_per_step()
        parts.append(f"{per_step:.2f} s/step" if per_step is not None else "- s/step")
        if self.validating_since is not None:
            parts.append(f"validating for {format_duration(now - self.validating_since)}")
        elif self.step_started is not None and now - self.step_started >= 5:
            what = "tracing the first step" if not self.step_seconds else "step running"
            parts.append(f"{what} for {format_duration(now - self.step_started)}")
        resident = rss_bytes()
        memory = f"mem {resident / GIB:.2f} GiB"
        if self.planned_peak_bytes:
            memory += (
                f" of {self.planned_peak_bytes / GIB:.2f} planned ({resident / self.planned_peak_bytes:.0%})"
            )
        parts.append(memory)
        parts.append(f"left {format_duration(self.time_left())}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        return "  ".join(parts)


class ProgressReporter:
    """Reports a :class:`ProgressState` from a thread: redrawn in a terminal, full lines in a log."""

    def __init__(
        self,
        state: ProgressState,
        stream: TextIO | None = None,
        interactive: bool | None = None,
        log_interval: float = 60.0,
    ):
        self.state = state
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.interval = 1.0 if self.interactive else log_interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_line = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bigmem-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.interactive:
            self._write("\n")

    def say(self, text: str) -> None:
        """A line of its own (an event: tracing, an epoch's result), kept above the redrawn status line."""
        with self._lock:
            self.stream.write(("\r\033[K" if self.interactive else "") + text + "\n")
            self.stream.flush()
            self._last_line = time.monotonic()

    def report(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self.interactive:
                self.stream.write("\r\033[K" + self.state.line(now, bar_width=20))
            else:
                self.stream.write("bigmem-train: " + self.state.line(now) + "\n")
            self.stream.flush()
            self._last_line = now

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.interval)):
            if self.interactive or time.monotonic() - self._last_line >= self.interval:
                self.report()


def _numbers(logs: dict | None) -> dict[str, float]:
    numbers = {}
    for key, value in (logs or {}).items():
        try:
            numbers[key] = float(value)
        except (TypeError, ValueError):
            continue
    return numbers


def progress_callback(
    epochs: int,
    steps_per_epoch: int,
    planned_peak_bytes: int | None,
    stream: TextIO | None = None,
    interactive: bool | None = None,
    log_interval: float = 60.0,
):
    """A Keras callback that shows the run's progress (see the module's docstring); imports Keras."""
    import keras

    state = ProgressState(epochs, steps_per_epoch, planned_peak_bytes)
    reporter = ProgressReporter(state, stream, interactive, log_interval)

    class Progress(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.state, self.reporter = state, reporter
            self._epoch_started = 0.0

        def on_train_begin(self, logs=None):
            reporter.say(
                "bigmem-train: tracing the training step (the first step compiles the graph; "
                "at large shapes this takes minutes)"
            )
            reporter.start()

        def on_epoch_begin(self, epoch, logs=None):
            state.epoch, state.step = epoch, 0
            self._epoch_started = time.monotonic()

        def on_train_batch_begin(self, batch, logs=None):
            state.step_started = time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            now = time.monotonic()
            seconds = now - (state.step_started or now)
            first = not state.step_seconds
            state.step_seconds.append(seconds)
            state.step, state.step_started = batch + 1, None
            state.loss = _numbers(logs).get("loss", state.loss)
            if first:
                reporter.say(
                    f"bigmem-train: first step done in {format_duration(seconds)} (graph tracing included)"
                )

        def on_test_begin(self, logs=None):
            state.validating_since = time.monotonic()

        def on_test_end(self, logs=None):
            if state.validating_since is not None:
                state.validation_seconds = time.monotonic() - state.validating_since
            state.validating_since = None

        def on_epoch_end(self, epoch, logs=None):
            figures = "  ".join(
                f"{key} {value:.4f}" for key, value in _numbers(logs).items() if key != "learning_rate"
            )
            per_step = state.seconds_per_step()
            speed = f"{per_step:.2f} s/step, " if per_step is not None else ""
            reporter.say(
                f"bigmem-train: epoch {epoch + 1}/{epochs} done in "
                f"{format_duration(time.monotonic() - self._epoch_started)} ({speed}left "
                f"{format_duration(state.time_left())}): {figures}"
            )
            state.epoch, state.step = epoch + 1, 0

        def on_train_end(self, logs=None):
            reporter.stop()

    return Progress()
