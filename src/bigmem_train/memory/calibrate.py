"""Measure real peak memory of a few training steps, and fit the planner's machine constants.

``measure_peak(config)`` runs the job in a child process (``python -m bigmem_train.memory.calibrate``) under
the runtime a real run has (``launch.runtime_environment``: the oneDNN switch, the configured
allocator preloaded; the run's intra/inter-op threads): TensorFlow is imported there, the model is
built by ``model.compile_model``, ``model.fit`` runs a few steps on random data of the right shape held
in memory (one batch, repeated), and the child reports its peak resident memory (``VmHWM``), the
allocator it really ran on and, under tcmalloc, the heap counters. One config per process, so nothing
of one run inflates the next.

``calibrate()`` measures small jobs and fits, by least squares, measured - (weights, gradients, Adam
slots, input, oneDNN's backward-weights scratchpad) = runtime baseline + activation factor x (tensors
alive at the backward peak) [+ workspace factor x one sample's largest patch matrix, with oneDNN off]; it
writes the constants, the model they belong to and the runtime they were measured under to
``~/.cache/bigmem-train/calibration.json`` (or ``$BIGMEM_CALIBRATION``).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Config, load_config
from ..errors import BadInput
from ..host import preloaded_allocator, read_host_facts
from ..launch import choose_threads, runtime_environment
from . import layers
from .constants import MODEL_VERSION, Calibration, calibration_path_for_user
from .estimate import breakdown_for

# Jobs the constants are fitted on, none of them in the accuracy sweep: batches 1..4, 1 and 4 channels,
# 8 and 16 filters, depths 3..4, peaks from 0.9 to about 2.7 GiB. The two larger jobs are there because
# the activation factor is not the same at every size: on jobs of 0.9-1.5 GiB the runtime baseline is
# 60-85 % of the peak and hides it, and fitted on those alone it came out too low for jobs of 2-4 GiB
# (the 160x152x104 job of tests/integration/test_target.py: -7 %). They cost about 5 of the ~13 minutes.
CALIBRATION_JOBS: list[dict[str, Any]] = [
    {"shape": (64, 64, 48), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (128, 64, 32), "batch": 1, "filters": 8, "depth": 4, "channels": 1},
    {"shape": (48, 48, 48), "batch": 4, "filters": 8, "depth": 3, "channels": 4},
    {"shape": (64, 64, 32), "batch": 1, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (64, 64, 48), "batch": 2, "filters": 16, "depth": 4, "channels": 1},
    {"shape": (144, 128, 96), "batch": 1, "filters": 8, "depth": 3, "channels": 1},
    {"shape": (112, 112, 96), "batch": 2, "filters": 8, "depth": 4, "channels": 1},
]


def job_config(base: Config, shape, batch: int, filters: int, depth: int, channels: int,
               precision: str = "float32") -> Config:
    """``base`` with this job's shape, batch, filters, depth, channels and precision."""
    data = base.model_dump()
    data["data"]["input_shape"] = tuple(shape)
    data["data"]["channels"] = list(range(channels))
    data["training"]["batch_size"] = batch
    data["model"]["base_filters"] = filters
    data["model"]["depth"] = depth
    data["runtime"]["precision"] = precision
    data["footprint"]["target"] = None
    return Config.model_validate(data)


def in_memory_input_bytes(config: Config) -> int:
    """What the measuring child's input holds: one batch of images and labels (float32), as a tensor."""
    return config.training.batch_size * config.voxels_per_sample * (config.num_channels + 1) * 4


def predicted_for_measurement(config: Config, calibration: Calibration) -> dict[str, int]:
    """The planner's breakdown for the measuring child (its input is one in-memory batch, not a reader)."""
    breakdown = breakdown_for(config, layers.layer_table(config), calibration, config.training.batch_size,
                              tuple(config.data.input_shape))
    breakdown["input_pipeline"] = in_memory_input_bytes(config)
    return breakdown


def measure_peak(config: Config, steps: int = 3, timeout: float = 1800) -> dict[str, Any]:
    """Run ``steps`` training steps of ``config`` in a child process; return its measured peak RSS etc."""
    # The runtime a real run has (bigmem-train run re-executes itself the same way): oneDNN switch and
    # the allocator preloaded; the child sets the run's threads itself.
    env = dict(runtime_environment(config), TF_CPP_MIN_LOG_LEVEL="3")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "bigmem_train.memory.calibrate", "--measure", str(steps)],
        input=config.model_dump_json(), capture_output=True, text=True, env=env, timeout=timeout,
    )
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-3:]
        raise BadInput(f"measuring child failed (exit {result.returncode}): {' | '.join(tail)}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["wall_seconds"] = round(time.monotonic() - started, 1)
    return measured


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def tcmalloc_stats() -> dict[str, int]:
    """gperftools' heap counters (bytes) when tcmalloc is preloaded, else {}: what the program holds
    (allocated), what tcmalloc keeps mapped for reuse (free in the page heap) and what it returned."""
    try:
        library = ctypes.CDLL(None)
        get = library.MallocExtension_GetNumericProperty
    except (OSError, AttributeError):
        return {}
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    stats = {}
    for name in ("generic.current_allocated_bytes", "generic.heap_size", "tcmalloc.pageheap_free_bytes",
                 "tcmalloc.pageheap_unmapped_bytes"):
        value = ctypes.c_size_t(0)
        if get(name.encode(), ctypes.byref(value)):
            stats[name.split(".", 1)[1]] = int(value.value)
    return stats


def reset_peak() -> None:
    """Reset this process's VmHWM to its current RSS (Linux clear_refs 5), to see each step's own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _measure_in_this_process(config: Config, steps: int) -> dict[str, Any]:
    """The child's side: build, compile and fit on one random in-memory batch; report VmHWM."""
    rss_start = status_bytes("VmRSS")
    import tensorflow as tf

    from ..model import compile_model

    # The threads a real run uses (launch.choose_threads): inter-op parallelism changes which backward
    # buffers coexist, so the measurement must match it.
    intra, inter = choose_threads(config, read_host_facts())
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)

    tf.keras.utils.set_random_seed(config.training.seed)
    model = compile_model(config)
    rss_model = status_bytes("VmRSS")
    batch, shape, channels = config.training.batch_size, config.data.input_shape, config.num_channels
    rng = np.random.default_rng(0)
    images = rng.standard_normal((batch, *shape, channels), dtype=np.float32)
    labels = (rng.random((batch, *shape, 1), dtype=np.float32) > 0.9).astype(np.float32)
    if config.model.output_classes > 1:
        labels = rng.integers(0, config.model.output_classes, (batch, *shape, 1)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
    del images, labels  # The dataset holds its own copy.
    rss_data = status_bytes("VmRSS")
    seconds, step_peaks = [], []
    overall = [status_bytes("VmHWM")]

    class StepTimer(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_index, logs=None):
            reset_peak()
            self.start = time.monotonic()

        def on_train_batch_end(self, batch_index, logs=None):
            seconds.append(time.monotonic() - self.start)
            step_peaks.append(status_bytes("VmHWM"))

    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[StepTimer()])
    return {
        "peak_rss_bytes": max(overall + step_peaks + [status_bytes("VmHWM")]),
        "step_peak_bytes": step_peaks,
        "rss_start_bytes": rss_start,
        "rss_model_bytes": rss_model,
        "rss_data_bytes": rss_data,
        "rss_end_bytes": status_bytes("VmRSS"),
        "step_seconds": [round(value, 2) for value in seconds],
        "tensorflow": tf.__version__,
        "threads": [intra, inter],
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
        "allocator": preloaded_allocator(),
        "tcmalloc_end": tcmalloc_stats(),
    }


def _solve(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares (normal equations) for a handful of unknowns, without numpy."""
    size = len(rows[0])
    matrix = [[sum(r[i] * r[j] for r in rows) for j in range(size)] + [sum(r[i] * t for r, t in zip(rows, targets))]
              for i in range(size)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(matrix[r][column]))
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        if matrix[column][column] == 0:
            raise BadInput("calibration jobs do not separate the constants; measure jobs of other sizes")
        for other in range(size):
            if other != column:
                ratio = matrix[other][column] / matrix[column][column]
                matrix[other] = [a - ratio * b for a, b in zip(matrix[other], matrix[column])]
    return [matrix[i][size] / matrix[i][i] for i in range(size)]


def fit_constants(samples: list[tuple[Config, int]]) -> Calibration:
    """Least squares of measured - (weights, gradients, slots, input, oneDNN scratchpad) = baseline +
    activation factor x (tensors alive at the backward peak) [+ workspace factor x one sample's largest
    patch matrix, with TensorFlow's own Conv3D kernels only].

    A slope that comes out negative is pinned to 0 and the others refitted (a factor below zero has no
    physical meaning; it happens when the jobs cannot separate the terms).
    """
    def features(config: Config, activation: float, workspace: float) -> int:
        calibration = Calibration(runtime_baseline_bytes=0, activation_factor=activation, workspace_factor=workspace)
        return sum(predicted_for_measurement(config, calibration).values())

    table, targets = [], []
    for config, measured in samples:
        rest = features(config, 0.0, 0.0)
        table.append([1.0, features(config, 1.0, 0.0) - rest, features(config, 0.0, 1.0) - rest])
        targets.append(measured - rest)
    # A term the runtime does not have (the column buffer under oneDNN) is 0 for every job: not fitted.
    measurable = [i for i in (1, 2) if any(row[i] for row in table)]
    free = [0] + measurable
    while True:
        solution = _solve([[row[i] for i in free] for row in table], targets)
        values = dict(zip(free, solution))
        negative = [i for i in free[1:] if values[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: values[i]))
    # Under oneDNN the column buffer cannot be measured: keep the built-in factor (about one sample's
    # patch matrix) for plans of jobs that switch oneDNN off, rather than a 0 that was never measured.
    workspace = round(values.get(2, 0.0), 4) if 2 in measurable else Calibration.workspace_factor
    return Calibration(runtime_baseline_bytes=int(values[0]), activation_factor=round(values.get(1, 0.0), 4),
                       workspace_factor=workspace)


def runtime_record(config: Config, measured: dict[str, Any]) -> dict[str, Any]:
    """How the constants were measured: the runtime the measuring children really had."""
    return {
        "tensorflow": measured.get("tensorflow"),
        "threads": measured.get("threads"),
        "host_cpus": os.cpu_count(),
        "onednn": str(measured.get("onednn")) in {"1", "true", "True"},
        "allocator": measured.get("allocator"),
        "requested": {"onednn": config.runtime.onednn, "allocator": config.runtime.allocator},
    }


def calibration_data(calibration: Calibration, measured: dict[str, Any]) -> dict[str, Any]:
    """The calibration file's content."""
    return {
        "model": MODEL_VERSION,
        "runtime_baseline_bytes": calibration.runtime_baseline_bytes,
        "activation_factor": calibration.activation_factor,
        "workspace_factor": calibration.workspace_factor,
        "measured": measured,
    }


# Each calibration job is measured this many times: the same job's peak varied by up to 6 % from one
# process to the next (allocation order), and every repeat halves that noise in the fit.
CALIBRATION_REPEATS = 2


def calibrate(base: Config | None = None, jobs: list[dict[str, Any]] | None = None,
              log: Callable[[str], None] | None = print, path: Path | None = None,
              repeats: int = CALIBRATION_REPEATS) -> Path:
    """Measure ``jobs`` (default ``CALIBRATION_JOBS``) ``repeats`` times each, fit the constants, store
    them; return the file."""
    base = base or load_config()
    samples, records = [], []
    for job in [job for _ in range(repeats) for job in jobs or CALIBRATION_JOBS]:
        config = job_config(base, **job)
        measured = measure_peak(config)
        samples.append((config, measured["peak_rss_bytes"]))
        records.append({**{k: list(v) if isinstance(v, tuple) else v for k, v in job.items()},
                        "peak_rss_bytes": measured["peak_rss_bytes"],
                        "rss_model_bytes": measured["rss_model_bytes"]})
        if log:
            log(f"  measured {job}: peak {measured['peak_rss_bytes'] / 2**30:.3f} GiB "
                f"({measured['wall_seconds']} s)")
    fitted = fit_constants(samples)
    path = path or (Path(os.environ["BIGMEM_CALIBRATION"]) if os.environ.get("BIGMEM_CALIBRATION")
                    else calibration_path_for_user())
    data = calibration_data(fitted, {
        "by": "bigmem-train plan --calibrate",
        "how": f"{len(records)} measurements ({repeats} of each job), each in its own process: model.fit, 3 steps "
               "on random in-memory data, "
               "the run's runtime (oneDNN switch, allocator preloaded, threads), peak RSS (VmHWM)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **runtime_record(base, measured),
        "jobs": records,
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--measure"]:
        config = Config.model_validate_json(sys.stdin.read())
        steps = int(argv[1]) if len(argv) > 1 else 3
        print(json.dumps(_measure_in_this_process(config, steps)))
        return 0
    print("usage: python -m bigmem_train.memory.calibrate --measure STEPS < config.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
