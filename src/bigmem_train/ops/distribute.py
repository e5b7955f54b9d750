"""Scale-out: one replica per host with ``tf.distribute.MultiWorkerMirroredStrategy``, from TF_CONFIG.

Every worker holds a whole copy of the model and trains on its share of each global batch; gradients
are summed across hosts after every step (a ring all-reduce over TCP), so all workers end each step
with the same weights. TF_CONFIG names the workers (``host:port``) and this process's index in that
list; it is rendered per host from an inventory group by ``templates/tf_config.json.j2``, the same
template Ansible's train role and ``bigmem-train remote start GROUP`` use.

Worker 0 is the chief: it owns the run directory that counts (checkpoints, verdict, report). The
others write to a run directory of their own (``NAME.worker1``, ...) that is removed of its
checkpoints when training ends, as the TensorFlow multi-worker Keras tutorial does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from bigmem_train.config import Config
from bigmem_train.errors import EXIT_FAIL, BadInput, BigmemError

TF_CONFIG_ENV = "TF_CONFIG"
TF_CONFIG_TEMPLATE = "tf_config.json.j2"
# The port each worker listens on when the inventory sets none has one source: the template's default.


@dataclass(frozen=True)
class WorkerCluster:
    """The cluster as TF_CONFIG describes it: the workers' addresses and which one this process is."""

    workers: tuple[str, ...]
    task_type: str
    index: int

    @property
    def count(self) -> int:
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        # With no explicit "chief" task, TensorFlow treats worker 0 as the chief.
        return self.task_type == "chief" or (self.task_type == "worker" and self.index == 0)


def parse_tf_config(text: str) -> WorkerCluster:
    """Parse and check a TF_CONFIG JSON string; BadInput with one line when it cannot work."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadInput(f"{TF_CONFIG_ENV} is not valid JSON ({error.msg} at char {error.pos})") from None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("cluster"), dict)
        or not isinstance(raw.get("task"), dict)
    ):
        raise BadInput(
            f'{TF_CONFIG_ENV} needs "cluster" and "task" objects, e.g. '
            '{"cluster": {"worker": ["a:12345", "b:12345"]}, "task": {"type": "worker", "index": 0}}'
        )
    cluster, task = raw["cluster"], raw["task"]
    workers = [*cluster.get("chief", []), *cluster.get("worker", [])]
    if not workers or not all(isinstance(address, str) and ":" in address for address in workers):
        raise BadInput(f'{TF_CONFIG_ENV} cluster.worker must list "host:port" addresses, got {workers}')
    for address in workers:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise BadInput(f"{TF_CONFIG_ENV} address {address!r} needs a host and a port from 1 to 65535")
    task_type, index = task.get("type"), task.get("index")
    members = cluster.get(task_type) if isinstance(task_type, str) else None
    if not members or not isinstance(index, int) or not 0 <= index < len(members):
        raise BadInput(f"{TF_CONFIG_ENV} task {task} does not name one of the cluster's members")
    if len(set(workers)) != len(workers):
        raise BadInput(f"{TF_CONFIG_ENV} lists an address twice: {workers}")
    return WorkerCluster(workers=tuple(workers), task_type=task_type, index=index)


def read_cluster(environ: Mapping[str, str] | None = None) -> WorkerCluster | None:
    """The cluster from the TF_CONFIG environment variable, or None when it is not set."""
    text = (os.environ if environ is None else environ).get(TF_CONFIG_ENV, "").strip()
    return parse_tf_config(text) if text else None


def is_chief(environ: Mapping[str, str] | None = None) -> bool:
    """True for the process whose run directory counts: worker 0, or any process without TF_CONFIG."""
    cluster = read_cluster(environ)
    return cluster is None or cluster.is_chief


def worker_count(environ: Mapping[str, str] | None = None) -> int:
    cluster = read_cluster(environ)
    return 1 if cluster is None else cluster.count


def worker_run_name(run_name: str, cluster: WorkerCluster | None) -> str:
    """The chief keeps the run's name; worker N writes to ``NAME.workerN`` (two workers may share a disk)."""
    if cluster is None or cluster.is_chief:
        return run_name
    return f"{run_name}.worker{cluster.index}"


def config_for_this_worker(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """The config this process runs: unchanged for one process or the chief, a worker run name otherwise.

    A multi-worker job needs a run name that is the same on every host, so each worker can find its
    run again when the job is resumed.
    """
    if config.training.strategy != "multi_worker":
        return config
    cluster = require_cluster(environ)
    if config.output.run_name is None:
        raise BadInput(
            "training.strategy multi_worker needs output.run_name (--run-name), the same on every worker"
        )
    name = worker_run_name(config.output.run_name, cluster)
    return config.model_copy(update={"output": config.output.model_copy(update={"run_name": name})})


def require_cluster(environ: Mapping[str, str] | None = None) -> WorkerCluster:
    cluster = read_cluster(environ)
    if cluster is None:
        raise BadInput(
            f"training.strategy multi_worker needs the {TF_CONFIG_ENV} environment variable "
            f"(render it with templates/{TF_CONFIG_TEMPLATE}; see docs/guides/remote-and-scale-out.md)"
        )
    return cluster


def planned_workers(config: Config, environ: Mapping[str, str] | None = None) -> int:
    """Workers the planner sizes a job for: TF_CONFIG's count for a multi_worker job, else 1.

    On a workstation, plan a multi-worker job with the TF_CONFIG of one of its hosts:
    ``TF_CONFIG="$(bigmem-train remote tf-config HOST)" bigmem-train plan -c job.yaml``.
    """
    if config.training.strategy != "multi_worker":
        return 1
    return worker_count(environ)


def per_worker_batch_size(config: Config, workers: int) -> int:
    """Samples each worker computes per step: training.batch_size is the global batch, split evenly."""
    if workers < 1:
        raise BadInput(f"worker count must be at least 1, got {workers}")
    if config.training.batch_size % workers:
        raise BadInput(
            f"training.batch_size {config.training.batch_size} must be divisible by the "
            f"{workers} workers (it is the global batch, split evenly across them)"
        )
    return config.training.batch_size // workers


def make_strategy(config: Config):
    """The distribution strategy for this process: the default one, or multi-worker from TF_CONFIG.

    Call it before TensorFlow runs any op: the collective ops of MultiWorkerMirroredStrategy are
    configured at program start. The call blocks until every worker of the cluster has started.
    """
    import tensorflow as tf

    if config.training.strategy != "multi_worker":
        return tf.distribute.get_strategy()
    cluster = require_cluster()
    per_worker_batch_size(config, cluster.count)
    _patch_keras_for_multi_worker()
    configure_coordination(config.training.worker_heartbeat_timeout)
    # Ring all-reduce over TCP: the implementation for CPU hosts (NCCL is for GPUs).
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def configure_coordination(heartbeat_timeout_s: float) -> None:
    """Configure TensorFlow's coordination service as MultiWorkerMirroredStrategy would, with a
    heartbeat timeout of our own.

    The strategy sets the service up only when nothing has yet (TensorFlow 2.21's
    ``collective_all_reduce_strategy``), with a 10 s heartbeat timeout and no way to pass another; so
    this sets it first, through the eager context's own setter (not public API: the strategy calls it
    the same way). The leader and the coordinated jobs are the ones the strategy would choose.
    """
    import tensorflow as tf
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    spec = tf.distribute.cluster_resolver.TFConfigClusterResolver().cluster_spec()
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        heartbeat_timeout_in_ms=round(heartbeat_timeout_s * 1000),
    )
    # The coordinated jobs go into the config the setter made (its protobuf module moves between
    # TensorFlow releases; the message it holds does not).
    coordination = context.context().coordination_service
    for job in ("chief", "worker"):
        if job in spec.jobs:
            coordination.coordinated_job_list.add(name=job, num_tasks=spec.num_tasks(job))


class WorkerLost(BigmemError):
    """A multi-worker job stopped because a worker stopped answering: exit 1, the job ran and did not finish
    (every worker resumes from its last finished epoch when the job is started again)."""

    exit_code = EXIT_FAIL


_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
# The coordination service's list of silent tasks: one task per line after the colon, nothing else (text
# after it, such as gRPC's "remote target /job:worker/replica:0/task:0", names other tasks).
_SILENT = re.compile(r"stopped sending heartbeats\):?\s*((?:/job:\w+/replica:\d+/task:\d+\s*)+)")


def _task_name(job: str, index: int, environ: Mapping[str, str] | None = None) -> str:
    """``worker 1 (10.0.0.12:12345)``: a TensorFlow task as TF_CONFIG names it, with its address."""
    try:
        address = json.loads((os.environ if environ is None else environ)[TF_CONFIG_ENV])["cluster"][job][
            index
        ]
    except (KeyError, IndexError, TypeError, ValueError):
        return f"{job} {index}"
    return f"{job} {index} ({address})"


def worker_lost(
    error: BaseException, config: Config, environ: Mapping[str, str] | None = None
) -> WorkerLost | None:
    """The one-line :class:`WorkerLost` for TensorFlow's error when a multi-worker job lost a worker, or
    None for any other error.

    TensorFlow's coordination service stops every worker's collective ops when a task sends no heartbeat
    for ``training.worker_heartbeat_timeout``: the task that holds the service (the chief) names the silent
    tasks; the others report that they cannot reach the service.
    """
    if config.training.strategy != "multi_worker":
        return None
    text = str(getattr(error, "message", error))
    timeout = f"{config.training.worker_heartbeat_timeout:g} s"
    if "stopped sending heartbeats" in text:
        listed = _SILENT.search(text)
        silent = [(job, int(index)) for job, index in _TASK.findall(listed.group(1) if listed else "")]
        silent = list(dict.fromkeys(silent))
        who = ", ".join(_task_name(job, index, environ) for job, index in silent) or "a worker"
        own = read_cluster(environ)  # checked when the job started
        if own is not None and (own.task_type, own.index) in silent:
            # The silent worker itself, once it runs again, hears the chief's verdict on it.
            who = f"this worker, {who},"
        what = f"{who} sent no heartbeat for {timeout} (training.worker_heartbeat_timeout)"
    elif type(error).__name__ in {"UnavailableError", "AbortedError"} or "Collective ops is aborted" in text:
        remote = re.search(f"remote target {_TASK.pattern}", text)
        if remote:
            peer = _task_name(remote.group(1), int(remote.group(2)), environ)
        elif "coordination service" in text:
            peer = f"the chief, {_task_name('worker', 0, environ)}, which holds the coordination service"
        else:
            peer = "another worker"
        what = f"this worker lost {peer}: it stopped, or stopped the job"
    else:
        return None
    return WorkerLost(
        f"multi-worker job stopped: {what}; TensorFlow stops every worker when one is lost. Start the job "
        "again on every host to resume from the last finished epoch (with a longer "
        "training.worker_heartbeat_timeout if a host was only slow)"
    )


_KERAS_PATCHED = False


def _patch_keras_for_multi_worker() -> None:
    """Work around two Keras 3 bugs that stop ``model.fit`` under MultiWorkerMirroredStrategy.

    keras-team/keras#20585 (open as of Keras 3.15): (1) the symbolic build reduces the first input
    batch with ``strategy.reduce``, which the collective strategy cannot do on a nested batch; (2) the
    per-step logs, scalars, are reduced with ``axis=0``. Here (1) takes this worker's local batch (it
    only needs shapes) and (2) averages the scalars across workers. Both are no-ops for other strategies.
    """
    global _KERAS_PATCHED
    if _KERAS_PATCHED:
        return
    import tensorflow as tf
    from keras import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    is_multi_worker = tf_trainer._collective_all_reduce_multi_worker
    original_reduce = tf_trainer.reduce_per_replica
    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction in ("auto", "mean") and is_multi_worker(strategy):
            return tree.map_structure(lambda value: strategy.reduce("MEAN", value, axis=None), values)
        return original_reduce(values, strategy, reduction)

    def maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not is_multi_worker(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = tree.map_structure(
                lambda value: (
                    strategy.experimental_local_results(value)[0]
                    if isinstance(value, tf.distribute.DistributedValues)
                    else value
                ),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    _KERAS_PATCHED = True


def templates_dir() -> Path:
    """The shared Jinja templates: ``templates/`` of the source tree, or the copy installed with the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[2] / "templates", here.parent / "templates"):
        if (candidate / TF_CONFIG_TEMPLATE).is_file():
            return candidate
    raise BadInput(f"template {TF_CONFIG_TEMPLATE} not found next to the package")


def render_tf_config(
    groups: Mapping[str, list[str]],
    hostvars: Mapping[str, Mapping[str, Any]],
    inventory_hostname: str,
    group: str,
) -> str:
    """Render TF_CONFIG for one host of an inventory group, as Ansible's template module would.

    The template sees Ansible's names (``groups``, ``hostvars``, ``inventory_hostname``) and the
    group in ``bigmem_train_group``, so one file serves both.
    """
    if group not in groups or not groups[group]:
        raise BadInput(f"inventory has no group {group!r} with hosts (groups: {', '.join(sorted(groups))})")
    if inventory_hostname not in groups[group]:
        raise BadInput(f"host {inventory_hostname} is not in inventory group {group}")
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    text = environment.get_template(TF_CONFIG_TEMPLATE).render(
        groups=groups,
        hostvars=hostvars,
        inventory_hostname=inventory_hostname,
        bigmem_train_group=group,
    )
    try:
        parse_tf_config(text)
    except BadInput as error:
        raise BadInput(
            f"inventory group {group}: {error} (the hosts' bigmem_train_worker_address or ansible_host, "
            "and bigmem_train_worker_port)"
        ) from None
    return text.strip()
