"""Starting the training process: the oneDNN switch, the allocator preloaded, numactl, threads, and the
plan handed to the re-executed process.

The allocator must be preloaded and the NUMA policy set before TensorFlow allocates anything, and oneDNN
is switched by the environment when TensorFlow loads; so ``bigmem-train run`` plans the job, then
re-executes itself once under numactl with LD_PRELOAD and hands the plan down (``PLAN_ENV``), typed back
into a :class:`~bigmem_train.memory.plan.JobPlan` on the other side.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bigmem_train.config import Config
from bigmem_train.host import HostFacts
from bigmem_train.memory.plan import JobPlan

# Set in the environment of a process this module re-executed, so it is done once only.
LAUNCHED_ENV = "BIGMEM_TRAIN_LAUNCHED"
# The plan the launching process made (sized config and plan.json), so the re-executed one does not plan
# the job again; keyed by a digest of the config it was made for.
PLAN_ENV = "BIGMEM_TRAIN_PLAN"

ALLOCATOR_LIBRARIES = {
    "jemalloc": ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"],
    "tcmalloc": [
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
        "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    ],
}


def allocator_library(allocator: str) -> str | None:
    """Path of the allocator's shared library, or None for glibc or when it is not installed.

    A missing library is a warning, not an error: the job still runs (slower, with a higher peak) on
    glibc malloc, and metrics.json records what was really preloaded.
    """
    if allocator == "glibc":
        return None
    for candidate in ALLOCATOR_LIBRARIES[allocator]:
        if Path(candidate).exists():
            return candidate
    package = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}[allocator]
    print(
        f"bigmem-train: warning: runtime.allocator {allocator} is not installed (apt-get install {package}); "
        "using glibc malloc",
        file=sys.stderr,
    )
    return None


def runtime_environment(config: Config, environment: dict[str, str] | None = None) -> dict[str, str]:
    """``environment`` (default: this process's) with the runtime a job of ``config`` trains under:
    TF_ENABLE_ONEDNN_OPTS from runtime.onednn, TF_ONEDNN_USE_SYSTEM_ALLOCATOR from runtime.tensor_allocator
    and the configured allocator in LD_PRELOAD.

    One definition for the run's launcher and for the planner's measuring children (calibration), so
    the constants are fitted on the kernels and the allocator a real run uses.
    """
    environment = dict(os.environ if environment is None else environment)
    environment["TF_ENABLE_ONEDNN_OPTS"] = "1" if config.runtime.onednn else "0"
    environment["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = (
        "1" if config.runtime.tensor_allocator == "system" else "0"
    )
    library = allocator_library(config.runtime.allocator)
    if library and library not in environment.get("LD_PRELOAD", ""):
        environment["LD_PRELOAD"] = ":".join(filter(None, [library, environment.get("LD_PRELOAD")]))
    return environment


# TensorFlow's inter-op parallelism -1, documented as running the ops in the calling thread. Under TensorFlow
# 2.21's function executor the ops of a training step still ran on two threads, partly side by side (profiler
# trace, docs/design/planner.md, Accuracy); the setting is kept for what was measured with it: the study's tile
# peaked the same in three runs (10.637-10.642 GiB) where an inter-op pool gave 10.20-11.66 GiB.
INLINE_OPS = -1


def choose_threads(config: Config, host: HostFacts, cpus: list[int] | None = None) -> tuple[int, int]:
    """Intra-op threads: configured, else the physical cores we may run on. Inter-op: ``INLINE_OPS``
    (-1) under runtime.inline_ops for a single-host job, else configured, else 1.

    The U-Net is a chain of large ops with little to overlap; every op uses all the intra-op threads.
    ``INLINE_OPS`` is the setting whose whole runs repeated best (its comment says what it does and does not
    do); one inter-op thread runs the ops strictly one at a time but repeated no better (docs/design/planner.md).
    """
    intra = config.runtime.intra_op_threads
    if intra is None:
        if cpus:
            share = len(cpus) / max(1, host.logical_cpus)
            intra = max(1, round(host.physical_cores * share))
        else:
            intra = host.physical_cores
    if config.runs_ops_inline:
        return intra, INLINE_OPS
    inter = config.runtime.inter_op_threads or 1
    return intra, inter


# TensorFlow's native start-up lines, written to stderr before its logging is configured (so
# TF_CPP_MIN_LOG_LEVEL cannot hide them): absl's notice, oneDNN's "custom operations are on", the CUDA
# probes of a GPU build on a CPU host. Shown with BIGMEM_TRAIN_TF_LOG=1.
TENSORFLOW_START_UP_NOISE = re.compile(
    r"All log messages before absl::InitializeLog|\] oneDNN custom operations are on|cudart_stub\.cc|"
    r"cuda_(platform|dnn|fft|blas|executor)\.cc|cuInit|Unable to register cu(DNN|FFT|BLAS) factory|"
    r"TF-TRT Warning|computation placer already registered|This TensorFlow binary is optimized to use"
)
TENSORFLOW_LOG_ENV = "BIGMEM_TRAIN_TF_LOG"


@contextmanager
def quiet_native_start_up() -> Iterator[None]:
    """Hold back TensorFlow's native start-up noise on stderr (file descriptor 2) while the block runs;
    every other line it wrote is passed on when the block ends."""
    if os.environ.get(TENSORFLOW_LOG_ENV, "") not in {"", "0"}:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines():
                if line.strip() and not TENSORFLOW_START_UP_NOISE.search(line):
                    print(line, file=sys.stderr)


def start_tensorflow(intra_op_threads: int, inter_op_threads: int, start_runtime: bool = True):
    """Import TensorFlow with these thread pools and start its runtime, without its start-up noise;
    returns the ``tensorflow`` module. ``start_runtime`` False leaves the runtime to start later: a
    multi-worker strategy must configure its collective ops before it starts."""
    with quiet_native_start_up():
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
        if start_runtime:
            tf.config.list_logical_devices("CPU")  # starts the runtime now, and its start-up lines with it
    return tf


def launch_command(config: Config, numactl_args: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to re-execute under, or None when this process is already right."""
    if os.environ.get(LAUNCHED_ENV):
        return None
    environment = runtime_environment(config)
    changed = environment.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD")
    prefix: list[str] = []
    if numactl_args and shutil.which(numactl_args[0]):
        prefix = numactl_args
        changed = True
    if not changed:
        return None
    environment[LAUNCHED_ENV] = "1"
    return [*prefix, sys.executable, "-m", "bigmem_train.cli", *sys.argv[1:]], environment


def _config_digest(config: Config) -> str:
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()


def handed_down_plan(config: Config, plan: JobPlan) -> str:
    """The value of PLAN_ENV for a re-executed process: ``plan``, made for the requested ``config``."""
    return json.dumps(
        {"for": _config_digest(config), "config": plan.config.model_dump(mode="json"), "plan": plan.to_dict()}
    )


def inherited_plan(config: Config) -> JobPlan | None:
    """The plan handed down by the process that re-executed this one for ``config``; None when this
    process was not re-executed, or the plan was made for another config or is not one (then it says so:
    the job is planned again)."""
    text = os.environ.pop(PLAN_ENV, None)
    if not text or not os.environ.get(LAUNCHED_ENV):
        return None
    try:
        data = json.loads(text)
        if data["for"] == _config_digest(config):
            return JobPlan.from_dict(Config.model_validate(data["config"]), data["plan"])
    except (ValueError, TypeError, KeyError):  # not JSON, not a dict, a field missing, an invalid config
        pass
    print(
        f"bigmem-train: the plan handed down in {PLAN_ENV} is not for this job; planning it again", flush=True
    )
    return None


def relaunch_if_needed(requested: Config, plan: JobPlan, host: HostFacts) -> None:
    """Switch oneDNN for this process, and re-execute it under numactl and the allocator when the plan
    asks for either (does not return then); the re-executed process takes ``plan`` (:func:`inherited_plan`).
    """
    # oneDNN is read once, when TensorFlow loads (the planner builds its model in a child process, so
    # TensorFlow is not loaded here yet).
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if plan.config.runtime.onednn else "0"
    os.environ["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = (
        "1" if plan.config.runtime.tensor_allocator == "system" else "0"
    )
    numactl = plan.placement.numactl_args() if len(host.numa_nodes) > 1 else []
    relaunch = launch_command(plan.config, numactl)
    if relaunch is None:
        return
    command, environment = relaunch
    environment[PLAN_ENV] = handed_down_plan(requested, plan)
    prefix = " ".join(command[: command.index(sys.executable)]) or "no numactl"
    print(
        f"bigmem-train: relaunching with LD_PRELOAD={environment.get('LD_PRELOAD', '') or '-'}, {prefix}",
        flush=True,
    )
    os.execvpe(command[0], command, environment)
