"""Training: threads, callbacks, ``model.fit``, and the figures of one run (metrics.json).

Keras does the work: ``model.fit`` with BackupAndRestore (a killed run resumes at its last finished
epoch), ModelCheckpoint (last and best), CSVLogger, TensorBoard, and :mod:`.progress` for a person watching. A
sampler thread records memory beside it, and the memory guard (guard.py) stops the run at a step boundary,
checkpoint saved, before the kernel's OOM killer would.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bigmem_train.config import Config
from bigmem_train.data.pipeline import bad_input_from, make_datasets
from bigmem_train.host import HostFacts, onednn_enabled, preloaded_allocator
from bigmem_train.memory.plan import JobPlan
from bigmem_train.ops import distribute
from bigmem_train.sizes import format_bytes
from bigmem_train.train.checkpoints import backup_and_restore, model_checkpoint
from bigmem_train.train.guard import MemoryGuard, MemoryStopped, guard_callback
from bigmem_train.train.launch import choose_threads, start_tensorflow
from bigmem_train.train.monitor import MemoryProbe, MemorySampler, peak_rss_bytes, rss_parts
from bigmem_train.train.progress import progress_callback
from bigmem_train.verdict.rundir import (
    read_history,
    read_memory_csv,
    read_step_seconds,
    write_json,
)


def tensorflow_build_info() -> dict[str, Any]:
    """TensorFlow and oneDNN as this process really runs them.

    ``onednn_requested`` is the TF_ENABLE_ONEDNN_OPTS switch (on by default on x86 Linux);
    ``onednn_built`` is what the TensorFlow build reports (``IsMklEnabled``). Only both together
    make the run "Intel-optimized" in the study's sense.
    """
    import tensorflow as tf

    try:
        from tensorflow.python.util import _pywrap_util_port

        onednn_built = bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        onednn_built = None
    requested = onednn_enabled()
    enabled = bool(requested and onednn_built)
    return {
        "tensorflow_version": tf.__version__,
        "keras_version": __import__("keras").__version__,
        "onednn_requested": requested,
        "onednn_built": onednn_built,
        "onednn_enabled": enabled,
        "intel_optimized": enabled,
    }


class StepTimer:
    """Keras callback factory: per-step wall times appended to steps.csv, progress to progress.json."""

    @staticmethod
    def create(path: Path, progress_path: Path, steps_per_epoch: int):
        import keras

        class _StepTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.durations: list[float] = []
                self.epoch = 0
                self._start = 0.0
                new_file = not path.exists()
                self._handle = open(path, "a", newline="")
                self._writer = csv.writer(self._handle)
                if new_file:
                    self._writer.writerow(["epoch", "step", "seconds", "time_unix"])

            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                seconds = time.perf_counter() - self._start
                self.durations.append(seconds)
                self._writer.writerow([self.epoch, batch, f"{seconds:.4f}", f"{time.time():.3f}"])
                self._handle.flush()
                write_json(
                    progress_path,
                    {
                        "epoch": self.epoch,
                        "step": batch + 1,
                        "steps_per_epoch": steps_per_epoch,
                        "time_unix": time.time(),
                    },
                )

            def on_train_end(self, logs=None):
                self._handle.close()

        return _StepTimer()


def compute_metrics(
    run_dir: Path,
    config: Config,
    plan: JobPlan | None,
    session_peak_bytes: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Figures of a run from its files (history, steps, memory), so a rerun of a stage agrees."""
    history = read_history(run_dir / "history.csv")
    steps = read_step_seconds(run_dir / "steps.csv")
    memory = read_memory_csv(run_dir / "memory.csv")
    # The first step of each session compiles the graph: leave it out of the median when there is more.
    timed = steps[1:] if len(steps) > 2 else steps
    median_step = statistics.median(timed) if timed else None
    # The sampled peak, and how much of it was file-backed (libraries, mapped files: it moves with the page
    # cache).
    at_peak = max(memory, key=lambda row: row.get("rss_bytes", 0), default={})
    sampled_peak = int(at_peak.get("rss_bytes", 0))
    file_at_peak = int(at_peak["rss_file_bytes"]) if "rss_file_bytes" in at_peak else None
    # ... and at the start (TensorFlow, the model and the reader loaded, no step yet): the figure the plan
    # took (JobPlan.with_file_backed), so calibration and the accuracy sweep use what the run's plan used;
    # without a plan, the first sample.
    file_at_start = plan.file_backed_measured_bytes if plan else None
    if not file_at_start and memory and memory[0].get("rss_file_bytes"):
        file_at_start = int(memory[0]["rss_file_bytes"])
    peak = max(sampled_peak, session_peak_bytes)
    voxels_per_step = config.voxels_per_sample * config.training.batch_size
    losses = [row.get("loss") for row in history if "loss" in row]
    val_dice = [row["val_dice"] for row in history if "val_dice" in row and not math.isnan(row["val_dice"])]
    val_hard = [row["val_hard_dice"] for row in history if "val_hard_dice" in row]
    node_peaks = {}
    for key in memory[0].keys() if memory else []:
        if key.startswith("node") and key.endswith("_bytes"):
            node_peaks[key[: -len("_bytes")]] = int(max(row.get(key, 0) for row in memory))
    huge_peak = int(max((row.get("anon_hugepages_bytes", 0) for row in memory), default=0))
    working_set_peak = int(max((row.get("working_set_bytes", 0) for row in memory), default=0))
    charged_peak = int(max((row.get("charged_bytes", 0) for row in memory), default=0))
    usable = [int(row["usable_bytes"]) for row in memory if "usable_bytes" in row]
    measure = (extra or {}).get("memory_measure") or "rss"
    # The judged peak: what the kernel's limit acts on when the run has a memory cgroup, else RSS.
    measured_peak = working_set_peak if measure != "rss" and working_set_peak else peak
    metrics: dict[str, Any] = {
        "memory_measure": measure,
        "peak_measured_bytes": measured_peak,
        "peak_measured_gib": round(measured_peak / 1024**3, 3),
        "peak_rss_bytes": peak,
        "peak_rss_gib": round(peak / 1024**3, 3),
        "peak_cgroup_working_set_bytes": working_set_peak or None,
        "peak_cgroup_charged_bytes": charged_peak or None,
        "least_usable_bytes": min(usable) if usable else None,
        "file_backed_at_peak_bytes": file_at_peak,
        "file_backed_at_start_bytes": file_at_start,
        "peak_anon_hugepages_bytes": huge_peak,
        "hugepage_share_at_peak": round(huge_peak / peak, 3) if peak else 0.0,
        "peak_numa_node_bytes": node_peaks,
        "planned_peak_bytes": plan.peak_bytes if plan else None,
        "target_bytes": plan.target_bytes if plan else None,
        # A job footprint.levers kept (its batch and shape) is not sized to the target: there the target
        # is a ceiling the run must stay under, not a size it must reach.
        "target_is_ceiling": bool(plan and plan.lever and plan.target_bytes),
        "lever": plan.lever if plan else None,
        "median_step_seconds": round(median_step, 4) if median_step else None,
        "steps": len(steps),
        "voxels_per_step": voxels_per_step,
        "voxels_per_second": round(voxels_per_step / median_step, 1) if median_step else None,
        "epochs_completed": len(history),
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "best_val_dice": max(val_dice) if val_dice else None,
        "best_val_hard_dice": max(val_hard) if val_hard else None,
        "input_shape": list(config.data.input_shape),
        "batch_size": config.training.batch_size,
        "precision": config.runtime.precision,
    }
    if plan and plan.peak_bytes and peak:
        # Against RSS: the planner models the process's own memory.
        metrics["planned_vs_measured_error"] = round((plan.peak_bytes - peak) / peak, 4)
    metrics.update(extra or {})
    return metrics


def _fit(model, datasets, config: Config, callbacks: list) -> None:
    model.fit(
        datasets.train,
        epochs=config.training.epochs,
        steps_per_epoch=datasets.train_steps,
        validation_data=datasets.validation,
        validation_steps=datasets.validation_steps,
        callbacks=callbacks,
        shuffle=False,  # the tf.data pipeline shuffles cases itself
        verbose=0,  # progress.progress_callback reports instead: memory and time left, and during long steps
    )


def train(
    config: Config,
    run_dir: Path,
    cases: tuple[list, list],
    plan: JobPlan | None,
    host: HostFacts,
    resuming: bool = False,
) -> dict[str, Any]:
    """Train the configured U-Net; write history, steps, memory, checkpoints and metrics.json."""
    intra, inter = choose_threads(config, host, plan.placement.cpus if plan else None)
    tf = start_tensorflow(intra, inter, start_runtime=config.training.strategy != "multi_worker")
    import keras

    from bigmem_train.model.unet import (
        compile_model,  # imports Keras, so TensorFlow: after the threads are set
    )

    keras.utils.set_random_seed(config.training.seed)
    strategy = tf.distribute.get_strategy()
    is_chief = True
    workers = 1
    if config.training.strategy == "multi_worker":
        strategy = distribute.make_strategy(config)
        is_chief = distribute.is_chief()
        workers = distribute.worker_count()

    train_cases, validation_cases = cases
    datasets = make_datasets(config, train_cases, validation_cases, workers=workers)
    with strategy.scope():
        model = compile_model(config)
    if plan is not None:
        # TensorFlow, the model and the reader are loaded: what this process maps of its libraries is
        # known now, and the plan takes it in place of the calibration's figure (JobPlan.with_file_backed).
        plan = plan.with_file_backed(rss_parts()[1])
        write_json(run_dir / "plan.json", plan.to_dict())

    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    step_timer = StepTimer.create(run_dir / "steps.csv", run_dir / "progress.json", datasets.train_steps)
    # double_checkpoint: the previous epoch's weights and metadata are kept beside the latest, and Keras falls
    # back to them when the latest cannot be opened. Each backup file is written whole and renamed into place
    # (checkpoints.backup_and_restore): a run killed while it wrote its backup resumes from the last whole one.
    backup = backup_and_restore(
        run_dir / "backup", save_freq="epoch", delete_checkpoint=True, double_checkpoint=True
    )
    probe = MemoryProbe()
    planned_peak = plan.peak_bytes if plan else None
    guard = MemoryGuard.for_config(config, planned_peak, probe) if config.guard.enabled else None
    callbacks = [
        backup,
        step_timer,
        keras.callbacks.CSVLogger(str(run_dir / "history.csv"), append=True),
        # Streamed to disk: Keras' own writer stages each file in memory (checkpoints.py).
        model_checkpoint(checkpoints / "last.keras"),
        model_checkpoint(checkpoints / "best.keras", monitor="val_dice", mode="max", save_best_only=True),
    ]
    if config.output.tensorboard:
        callbacks.append(keras.callbacks.TensorBoard(str(run_dir / "tensorboard"), update_freq="epoch"))
    if guard is not None:
        # After the step timer, so the step that tripped it is recorded.
        callbacks.insert(2, guard_callback(guard, backup, config, run_dir))
    if is_chief:
        callbacks.append(
            progress_callback(config.training.epochs, datasets.train_steps, plan.peak_bytes if plan else None)
        )

    build = tensorflow_build_info()
    numa_nodes = [node.node_id for node in host.numa_nodes]
    print(
        f"bigmem-train: training {config.data.input_shape} x batch {config.training.batch_size}, "
        f"{datasets.train_steps} steps/epoch, {config.training.epochs} epochs, {intra} threads, "
        f"{'ops inline' if inter == -1 else f'{inter} inter-op'}, "
        f"oneDNN {'on' if build['onednn_enabled'] else 'off'}"
        + (" (resuming from backup)" if resuming else ""),
        flush=True,
    )
    started = time.time()
    listeners = [guard.observe] if guard is not None else []
    print(
        f"bigmem-train: memory measured as {probe.measure}"
        + (
            f" ({probe.cgroup.path}, limit {format_bytes(probe.cgroup.limit_bytes())})"
            if probe.cgroup is not None and probe.cgroup.limit_bytes()
            else ""
        )
        + (
            f"; guard stops at {config.guard.threshold:.0%} of usable memory"
            if guard is not None
            else "; guard off"
        ),
        flush=True,
    )
    stopped: MemoryStopped | None = None
    with MemorySampler(
        run_dir / "memory.csv", config.output.sample_interval, numa_nodes, probe=probe, listeners=listeners
    ) as sampler:
        try:
            _fit(model, datasets, config, callbacks)
        except MemoryStopped as error:
            stopped = error
        except tf.errors.OpError as error:
            # A volume that turned out unreadable mid-run: one line naming the file, exit 2.
            bad_input = bad_input_from(error)
            if bad_input is not None:
                raise bad_input from None
            # A multi-worker job whose peer went silent: one line saying which, not TensorFlow's trace.
            lost = distribute.worker_lost(error, config)
            if lost is None:
                raise
            raise lost from None
    session_peak = peak_rss_bytes()
    extra = {
        **build,
        "intra_op_threads": intra,
        "inter_op_threads": inter,
        "train_seconds_this_session": round(time.time() - started, 1),
        "memory_samples_this_session": sampler.samples,
        "train_cases": len(train_cases),
        "validation_cases": len(validation_cases),
        "validation_padded_samples": datasets.validation_padding,
        "workers": workers,
        "allocator_requested": config.runtime.allocator,
        "allocator": preloaded_allocator(),
        "tensor_allocator": "system" if os.environ.get("TF_ONEDNN_USE_SYSTEM_ALLOCATOR") == "1" else "bfc",
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "numa_policy": plan.placement.policy if plan else "none",
        "strategy": config.training.strategy,
        "resumed": resuming,
        "memory_measure": probe.measure,
        "cgroup": None
        if probe.cgroup is None
        else {
            "version": probe.cgroup.version,
            "path": probe.cgroup.path,
            "limit_bytes": probe.cgroup.limit_bytes(),
            "kernel_peak_bytes": probe.cgroup.peak_bytes(),
        },
        "sampler_cpu_seconds": round(sampler.cpu_seconds, 3),
        "sampler_page_table_walks": sampler.walks,
        "guard": None
        if guard is None
        else {
            "threshold": config.guard.threshold,
            "room": config.guard.room,
            "stopped": stopped.record if stopped else None,
        },
    }
    metrics = compute_metrics(run_dir, config, plan, session_peak, extra)
    write_json(run_dir / "metrics.json", metrics)
    if stopped is not None:
        raise stopped
    return metrics
