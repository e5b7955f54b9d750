"""One job end to end: config -> host -> plan -> preflight -> data -> train -> validate -> report.

Every stage writes into the run directory; nothing is written before the config, the plan and the
data have been checked, so bad input (exit 2) and a job that cannot fit (exit 3) leave no run behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from .config import Config
from .errors import EXIT_FAIL, EXIT_PASS, BadInput
from .host import read_host_facts
from .guard import MemoryStopped
from .rundir import FAILED, FINISHED, STOPPED, ensure_writable, prepare_run_dir, set_state, write_json
from .sizes import format_bytes

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
    print(f"bigmem-train: warning: runtime.allocator {allocator} is not installed (apt-get install {package}); "
          "using glibc malloc", file=sys.stderr)
    return None


def runtime_environment(config: Config, environment: dict[str, str] | None = None) -> dict[str, str]:
    """``environment`` (default: this process's) with the runtime a job of ``config`` trains under:
    TF_ENABLE_ONEDNN_OPTS from runtime.onednn and the configured allocator in LD_PRELOAD.

    One definition for the run's launcher and for the planner's measuring children (calibration), so
    the constants are fitted on the kernels and the allocator a real run uses.
    """
    environment = dict(os.environ if environment is None else environment)
    environment["TF_ENABLE_ONEDNN_OPTS"] = "1" if config.runtime.onednn else "0"
    library = allocator_library(config.runtime.allocator)
    if library and library not in environment.get("LD_PRELOAD", ""):
        environment["LD_PRELOAD"] = ":".join(filter(None, [library, environment.get("LD_PRELOAD")]))
    return environment


def launch_command(config: Config, numactl_args: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to re-execute under, or None when this process is already right.

    The allocator must be preloaded and the NUMA policy set before TensorFlow allocates anything, so
    the CLI re-executes itself once with LD_PRELOAD and under numactl.
    """
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


def handed_down_plan(config: Config, sized: Config, plan_dict: dict) -> str:
    """The value of PLAN_ENV for a re-executed process: the plan made for ``config``."""
    return json.dumps({"for": _config_digest(config), "config": sized.model_dump(mode="json"), "plan": plan_dict})


def inherited_plan(config: Config) -> tuple[Config, dict] | None:
    """(sized config, plan.json) handed down by the process that re-executed this one for ``config``;
    None when this process was not re-executed, or the plan was made for another config or is not one
    (then it says so: the job is planned again)."""
    text = os.environ.pop(PLAN_ENV, None)
    if not text or not os.environ.get(LAUNCHED_ENV):
        return None
    try:
        data = json.loads(text)
        if data["for"] == _config_digest(config):
            return Config.model_validate(data["config"]), data["plan"]
    except (ValueError, TypeError, KeyError):  # not JSON, not a dict, a field missing, an invalid config
        pass
    print(f"bigmem-train: the plan handed down in {PLAN_ENV} is not for this job; planning it again", flush=True)
    return None


def _synthetic_dataset(config: Config) -> Path:
    from .synth import write_synthetic_dataset

    data = config.data
    shape = "x".join(str(edge) for edge in data.synthetic_shape)
    folder = Path(config.output.results_dir) / f"synthetic-{data.synthetic_cases}cases-{shape}-seed{data.synthetic_seed}"
    print(f"bigmem-train: synthetic dataset {folder}", flush=True)
    return write_synthetic_dataset(folder, cases=data.synthetic_cases, shape=data.synthetic_shape,
                                   seed=data.synthetic_seed)


def run_job(config: Config, validate_and_report: bool = True) -> int:
    """Run one job; returns the exit code (0 PASS, 1 FAIL). Raises BadInput / DoesNotFit early."""
    from .planner import plan_job
    from .preflight import check_fits

    host = read_host_facts()
    # A multi-worker job: check TF_CONFIG now; a non-chief worker writes its own run directory.
    from .distribute import config_for_this_worker, is_chief

    config = config_for_this_worker(config)
    chief = config.training.strategy != "multi_worker" or is_chief()
    if config.data.source == "decathlon":
        # Cheap checks on the dataset folder before planning; the full integrity check follows.
        if not Path(config.data.path).is_dir():
            raise BadInput(f"dataset folder {config.data.path} does not exist")
        if not (Path(config.data.path) / "dataset.json").is_file():
            raise BadInput(f"dataset folder {config.data.path} has no dataset.json (expected the Decathlon layout)")
    ensure_writable(Path(config.output.results_dir))

    # Planned once: a process re-executed below under numactl/LD_PRELOAD takes the plan it is handed.
    inherited = inherited_plan(config)
    if inherited is not None:
        config, plan_dict = inherited
    else:
        requested = config
        plan = plan_job(config, host)
        check_fits(plan, host)
        config = plan.config
        plan_dict = plan.to_dict()
        print(f"bigmem-train: planned peak {format_bytes(plan.peak_bytes)}"
              + (f", target {format_bytes(plan.target_bytes)}" if plan.target_bytes else "")
              + f", NUMA {plan.placement.policy}", flush=True)
        if plan.calibration_warning:
            print(f"bigmem-train: warning: planner constants {plan.calibration_source}: {plan.calibration_warning}",
                  flush=True)

        # oneDNN is switched by the environment and read once, when TensorFlow loads (the planner builds
        # its model in a child process, so TensorFlow is not loaded here yet).
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if config.runtime.onednn else "0"
        relaunch = launch_command(config, plan.placement.numactl_args() if len(host.numa_nodes) > 1 else [])
        if relaunch is not None:
            command, environment = relaunch
            environment[PLAN_ENV] = handed_down_plan(requested, config, plan_dict)
            numactl = " ".join(command[: command.index(sys.executable)]) or "no numactl"
            print(f"bigmem-train: relaunching with LD_PRELOAD={environment.get('LD_PRELOAD', '') or '-'}, "
                  f"{numactl}", flush=True)
            os.execvpe(command[0], command, environment)

    from .data import balance_split, check_dataset, split_cases
    from .distribute import planned_workers

    if config.data.source == "synthetic":
        config = config.model_copy(update={"data": config.data.model_copy(update={"path": _synthetic_dataset(config)})})
    cases = check_dataset(config)
    train_cases, validation_cases = split_cases(cases, config.data.validation_fraction, config.data.split_seed)
    if planned_workers(config) > 1:
        train_cases, validation_cases = balance_split(train_cases, validation_cases, config.training.batch_size)

    run_dir, resuming = prepare_run_dir(config)
    print(f"bigmem-train: run directory {run_dir}", flush=True)
    write_json(run_dir / "host.json", host.to_dict())
    write_json(run_dir / "plan.json", plan_dict)
    write_json(run_dir / "split.json", {"train": [case.name for case in train_cases],
                                        "validation": [case.name for case in validation_cases]})
    try:
        from .train import train

        train(config, run_dir, (train_cases, validation_cases), plan_dict, host, resuming)
    except MemoryStopped as stop:
        # Checkpoint saved: state.json says `stopped: memory`, and a rerun with a smaller batch resumes.
        set_state(run_dir, STOPPED, **stop.record)
        raise
    except BaseException as error:
        # A killed or failed run stays resumable and never looks finished.
        set_state(run_dir, FAILED, error=f"{type(error).__name__}: {error}"[:2000])
        raise
    set_state(run_dir, FINISHED)
    # The chief's run directory is the job's; the other workers' only record their side.
    if not validate_and_report or not chief:
        print(f"TRAINED {run_dir}")
        return EXIT_PASS
    from .report import write_report
    from .validate import print_verdict, validate_run

    verdict = validate_run(run_dir)
    report = write_report(run_dir)
    print(f"bigmem-train: report {report}")
    print_verdict(verdict)
    return EXIT_PASS if verdict.passed else EXIT_FAIL
