"""One job end to end: config -> host -> plan -> preflight -> launch -> data -> train -> validate -> report.

Every stage writes into the run directory; nothing is written before the config, the plan and the
data have been checked, so bad input (exit 2) and a job that cannot fit (exit 3) leave no run behind.
"""

from __future__ import annotations

from pathlib import Path

from bigmem_train.config import Config
from bigmem_train.data.reader import check_dataset_folder
from bigmem_train.data.split import training_split
from bigmem_train.data.synth import write_synthetic_dataset
from bigmem_train.errors import EXIT_FAIL, EXIT_PASS
from bigmem_train.host import HostFacts, read_host_facts
from bigmem_train.infer.predict import PredictRequest, predict
from bigmem_train.infer.source import ImageCase, resolve_model
from bigmem_train.memory.plan import JobPlan, plan_job
from bigmem_train.memory.preflight import check_fits
from bigmem_train.ops.distribute import config_for_this_worker, is_chief, planned_workers
from bigmem_train.sizes import format_bytes
from bigmem_train.train import launch
from bigmem_train.train.guard import MemoryStopped
from bigmem_train.train.loop import train
from bigmem_train.verdict.evaluate import evaluate_pairs
from bigmem_train.verdict.report import write_report
from bigmem_train.verdict.rundir import (
    FAILED,
    FINISHED,
    STOPPED,
    ensure_writable,
    prepare_run_dir,
    set_state,
    write_json,
)
from bigmem_train.verdict.validate import EVALUATION_DIR, format_verdict, validate_run


def run_job(config: Config, validate_and_report: bool = True) -> int:
    """Run one job; returns the exit code (0 PASS, 1 FAIL). Raises BadInput / DoesNotFit early."""
    host = read_host_facts()
    config = config_for_this_worker(config)  # a multi-worker job: TF_CONFIG checked, the worker's run name
    check_dataset_folder(config)
    ensure_writable(Path(config.output.results_dir))
    plan = launch.inherited_plan(config) or plan_and_launch(config, host)
    config = with_dataset(plan.config)
    cases = training_split(config, planned_workers(config))
    run_dir, resuming = prepare_run_dir(config)
    print(f"bigmem-train: run directory {run_dir}", flush=True)
    write_run_inputs(run_dir, host, plan, cases)
    train_run(run_dir, plan, cases, host, resuming)
    # The chief's run directory is the job's; the other workers' only record their side.
    if not validate_and_report or not (config.training.strategy != "multi_worker" or is_chief()):
        print(f"TRAINED {run_dir}")
        return EXIT_PASS
    evaluate_whole_volumes(run_dir, cases[1])
    return validate_and_write_report(run_dir)


def plan_and_launch(config: Config, host: HostFacts) -> JobPlan:
    """Plan the job, refuse it when it cannot fit, and re-execute under the runtime it needs (a
    re-executed process takes the plan handed down instead of calling this)."""
    plan = plan_job(config, host)
    check_fits(plan, host)
    target = f", target {format_bytes(plan.target_bytes)}" if plan.target_bytes else ""
    print(
        f"bigmem-train: planned peak {format_bytes(plan.peak_bytes)}{target}, NUMA {plan.placement.policy}",
        flush=True,
    )
    if statement := plan.range_statement():
        print(f"bigmem-train: {statement}", flush=True)
    if plan.calibration_warning:
        print(
            f"bigmem-train: warning: planner constants {plan.calibration_source}: {plan.calibration_warning}",
            flush=True,
        )
    launch.relaunch_if_needed(config, plan, host)
    return plan


def with_dataset(config: Config) -> Config:
    """``config`` reading its dataset from a folder: a synthetic one is written (or reused) first."""
    if config.data.source != "synthetic":
        return config
    data = config.data
    shape = "x".join(str(edge) for edge in data.synthetic_shape)
    folder = (
        Path(config.output.results_dir)
        / f"synthetic-{data.synthetic_cases}cases-{shape}-seed{data.synthetic_seed}"
    )
    print(f"bigmem-train: synthetic dataset {folder}", flush=True)
    path = write_synthetic_dataset(
        folder, cases=data.synthetic_cases, shape=data.synthetic_shape, seed=data.synthetic_seed
    )
    return config.model_copy(update={"data": data.model_copy(update={"path": path})})


def write_run_inputs(run_dir: Path, host: HostFacts, plan: JobPlan, cases: tuple[list, list]) -> None:
    train_cases, validation_cases = cases
    write_json(run_dir / "host.json", host.to_dict())
    write_json(run_dir / "plan.json", plan.to_dict())
    write_json(
        run_dir / "split.json",
        {
            "train": [case.name for case in train_cases],
            "validation": [case.name for case in validation_cases],
        },
    )


def train_run(
    run_dir: Path, plan: JobPlan, cases: tuple[list, list], host: HostFacts, resuming: bool
) -> None:
    """Train, keeping the state file honest: a killed, failed or memory-stopped run stays resumable and never
    looks finished."""
    try:
        train(plan.config, run_dir, cases, plan, host, resuming)
    except MemoryStopped as stop:
        # Checkpoint saved: state.json says `stopped: memory`, and a rerun with a smaller batch resumes.
        # Still ``leaving`` (postmortem.after_memory_stop) until the CLI has said so and exits at once.
        set_state(run_dir, STOPPED, **stop.record)
        stop.run_dir = run_dir
        raise
    except BaseException as error:
        set_state(run_dir, FAILED, error=f"{type(error).__name__}: {error}"[:2000])
        raise
    set_state(run_dir, FINISHED)


def evaluate_whole_volumes(run_dir: Path, validation_cases: list) -> dict:
    """The best checkpoint on the validation cases at full size, as ``predict`` and ``evaluate`` would:
    RUN_DIR/evaluation/ holds the masks, predict.json and evaluation.{json,csv,html,png}."""
    source = resolve_model(run_dir)
    out_dir = run_dir / EVALUATION_DIR
    masks = out_dir / "predictions"
    images = [ImageCase(case.name, case.image, case.shape, case.channels) for case in validation_cases]
    print(
        f"bigmem-train: evaluating {source.model_path.name} on {len(images)} whole validation volume(s)",
        flush=True,
    )
    # TensorFlow, already loaded by training: no conversion for OpenVINO in the training process.
    summary = predict(PredictRequest(source, images, masks, engine="tensorflow"))
    pairs = [
        (case.name, masks / summary["cases"][case.name]["output"], case.label) for case in validation_cases
    ]
    return evaluate_pairs(pairs, summary, out_dir, str(masks), "the run's validation labels")


def validate_and_write_report(run_dir: Path) -> int:
    verdict = validate_run(run_dir)
    report = write_report(run_dir)
    print(f"bigmem-train: report {report}")
    print(format_verdict(verdict))
    return EXIT_PASS if verdict.passed else EXIT_FAIL
