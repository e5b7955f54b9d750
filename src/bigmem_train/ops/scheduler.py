"""Slurm: submit a planned job with its plan as the memory request (``bigmem-train submit``).

The batch script is rendered from ``templates/slurm_job.sh.j2``; ``#SBATCH --mem`` is the plan's envelope
peak with the 3 % it promises no run passes, over the memory guard's share of a limit, rounded up to MiB
(:func:`mem_request_mib`), so the scheduler places the job only where that much memory is free and runs the
next job beside it only when both fit. A job fewer than its --nodes of the partition's nodes can hold
(``sinfo -N`` RealMemory) is refused before anything is submitted.

A ``training.strategy: multi_worker`` job on N nodes asks for N nodes, one task each, and ``--mem`` the plan
of one worker (its share of the global batch); ``srun`` starts the workers, and each builds its TF_CONFIG
from Slurm's environment (:func:`slurm_tf_config`, ``bigmem-train slurm tf-config``) before it runs.

The job runs this environment's ``bigmem-train`` (``--venv``, the default), or with ``--image`` the kit's
Docker image on the node: the `docker run` that ``bigmem-train remote start`` builds, in the foreground.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from time import monotonic, sleep
from typing import Any

import yaml

from bigmem_train.config import Config
from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.memory.constants import PLAN_COVERAGE
from bigmem_train.memory.plan import JobPlan
from bigmem_train.ops.distribute import render_tf_config
from bigmem_train.ops.render import render
from bigmem_train.sizes import format_bytes
from bigmem_train.verdict.postmortem import SLURM_ENDED

MIB = 1024**2
TEMPLATE = "slurm_job.sh.j2"
# Slurm's --time formats (sbatch(1)): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, and UNLIMITED.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
_TIMEOUT_S = 15
# The all-reduce port of a multi-node job's workers: one per job (from its id), so two jobs sharing a node
# do not collide; below Linux's ephemeral ports (32768 and up).
WORKER_PORT_BASE = 20000
WORKER_PORT_SPAN = 10000


def run_client(command: list[str], **options) -> subprocess.CompletedProcess:
    """Run one Slurm client command (the tests replace this with a stand-in for sinfo and sbatch)."""
    return subprocess.run(command, **options)


@dataclass(frozen=True)
class Partition:
    """A partition as ``sinfo -N`` shows it: each node's memory (RealMemory, MiB), and its largest node's CPUs."""

    name: str
    node_memories_mib: tuple[int, ...]
    cpus_per_node: int

    @property
    def node_memory_mib(self) -> int:
        return max(self.node_memories_mib)

    @property
    def nodes(self) -> int:
        return len(self.node_memories_mib)

    def nodes_holding(self, request_mib: int) -> int:
        """How many of its nodes have at least ``request_mib`` of RealMemory."""
        return sum(memory >= request_mib for memory in self.node_memories_mib)


def check_time(text: str) -> str:
    """``text`` if it is one of Slurm's --time formats, else BadInput."""
    value = text.strip()
    if value.upper() in {"UNLIMITED", "INFINITE"} or _TIME.match(value):
        return value
    raise BadInput(
        f"--time {text!r}: not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)"
    )


def mem_request_mib(plan: JobPlan) -> int:
    """``#SBATCH --mem`` in MiB: the smallest limit under which a run that keeps its plan's promise (it ends at
    most PLAN_COVERAGE above the plan) is stopped neither by the cgroup nor by the kit's memory guard (which
    trips at ``guard.threshold`` of the limit), rounded up. It is the inverse of the preflight's allowance
    under a cgroup limit (memory.plan.allowance): a job given its request passes its own preflight."""
    return math.ceil(plan.peak_bytes * (1 + PLAN_COVERAGE) / plan.config.guard.threshold / MIB)


def _slurm(command: Sequence[str], stdin: str | None = None, unknown: str | None = None) -> str:
    """Run a Slurm client; BadInput (one line) when it is missing, hangs or fails. ``unknown``: an error
    message that is an answer, not a failure (``Invalid job id``): "" is returned for it."""
    try:
        done = run_client(
            list(command), input=stdin, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise BadInput(
            f"{command[0]} not found: is the Slurm client (slurm-client) installed on this host?"
        ) from None
    except subprocess.TimeoutExpired:
        raise BadInput(f"{command[0]} did not answer within {_TIMEOUT_S} s: is slurmctld running?") from None
    if done.returncode != 0 and unknown and unknown in (done.stderr or ""):
        return ""
    if done.returncode != 0:
        detail = " ".join((done.stderr or done.stdout or "").split()) or f"exit code {done.returncode}"
        raise BadInput(f"{' '.join(command[:2])}: {detail}")
    return done.stdout


def read_partition(name: str | None) -> Partition:
    """The partition ``name`` (default: the cluster's default partition) from ``sinfo``, node by node."""
    command = ["sinfo", "-h", "-N", "-o", "%N %P %m %c"]
    if name:
        command += ["-p", name]
    lines = [line.split() for line in _slurm(command).splitlines() if line.strip()]
    try:
        if name:
            rows = [row for row in lines if row[1].rstrip("*") == name]
            if not rows:
                raise BadInput(f"--partition {name}: no such partition (sinfo shows: {_names()})")
        else:
            rows = [row for row in lines if row[1].endswith("*")]
            if not rows:
                raise BadInput("no default partition in this cluster: name one with --partition")
        # A line per node (and per partition it is in); a node is counted once.
        nodes = {row[0]: (int(row[2]), int(row[3])) for row in rows}
    except (IndexError, ValueError):
        raise BadInput(f"sinfo: unexpected output {' | '.join(' '.join(row) for row in lines)!r}") from None
    return Partition(
        rows[0][1].rstrip("*"),
        tuple(memory for memory, _ in nodes.values()),
        max(cpus for _, cpus in nodes.values()),
    )


def _names() -> str:
    try:
        text = _slurm(["sinfo", "-h", "-o", "%P"])
    except BadInput:
        return "?"
    # sinfo marks the default partition "name*".
    return (
        ", ".join(sorted({line.strip().rstrip("*") for line in text.splitlines() if line.strip()})) or "none"
    )


def check_nodes(nodes: int, strategy: str) -> None:
    """BadInput unless ``nodes`` can carry a job of ``strategy``; asks Slurm nothing (checked first)."""
    if nodes < 1:
        raise BadInput(f"--nodes {nodes}: give 1 or more")
    if nodes > 1 and strategy != "multi_worker":
        raise BadInput(
            f"--nodes {nodes}: training.strategy is {strategy}, which trains on one node; "
            f"a job on several nodes needs training.strategy multi_worker"
        )


def check_nodes_in_partition(nodes: int, partition: Partition) -> None:
    """BadInput when the partition has fewer than ``nodes`` nodes: the job would wait in the queue for ever."""
    if nodes > partition.nodes:
        raise BadInput(f"--nodes {nodes}: partition {partition.name} has {partition.nodes} node(s)")


def check_fits_partition(plan: JobPlan, partition: Partition, nodes: int = 1) -> None:
    """DoesNotFit (exit 3) when fewer than ``nodes`` of the partition's nodes can hold the plan's memory request
    (per node): Slurm would keep the job waiting for ever. A partition of unequal nodes may hold it on some."""
    request = mem_request_mib(plan)
    holding = partition.nodes_holding(request)
    if holding >= nodes:
        return
    if holding == 0:
        raise DoesNotFit(
            f"the plan ({format_bytes(plan.peak_bytes)}, --mem={request}M) does not fit partition "
            f"{partition.name}: its largest node has RealMemory {partition.node_memory_mib}M "
            f"({format_bytes(partition.node_memory_mib * MIB)})"
        )
    raise DoesNotFit(
        f"the plan ({format_bytes(plan.peak_bytes)}, --mem={request}M per node) fits {holding} of partition "
        f"{partition.name}'s {partition.nodes} nodes, and --nodes {nodes} needs {nodes} (RealMemory of its "
        f"nodes: {', '.join(f'{memory}M' for memory in sorted(partition.node_memories_mib, reverse=True))})"
    )


def bigmem_train_executable() -> Path:
    """The ``bigmem-train`` of this environment (beside the running Python), as the job should run it."""
    return Path(sys.executable).parent / "bigmem-train"


@dataclass(frozen=True)
class RunFlags:
    """The flags of the job's ``bigmem-train run`` as ``submit`` was given them, paths absolute."""

    # A config file, or a preset name; None: the built-in default job.
    config: str | None
    overrides: tuple[str, ...]
    target: str | None
    # --data as given, or None (a dataset the config names is in the config).
    data: str | None
    results: str
    run_name: str

    def venv_arguments(self) -> list[str]:
        """The flags as this host's paths: the job runs this environment's bigmem-train on shared storage."""
        arguments = ["--config", self.config] if self.config else []
        for text in self.overrides:
            arguments += ["--set", text]
        if self.target:
            arguments += ["--target", self.target]
        if self.data:
            arguments += ["--data", self.data]
        return [*arguments, "--results", self.results, "--run-name", self.run_name]


def venv_command(flags: RunFlags) -> str:
    """The job's command line with ``--venv``: this environment's bigmem-train, by its absolute path."""
    return shlex.join([str(bigmem_train_executable()), "run", *flags.venv_arguments()])


# Slurm's record of the job, which the run keeps in state.json (postmortem asks Slurm how the job ended).
_SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_CLUSTER_NAME", "SLURM_MEM_PER_NODE")


def check_image(image: str) -> None:
    """BadInput (one line) unless Docker on this host knows ``image``: the nodes are assumed to hold the
    same image, and a name this host does not know is most likely a typo."""
    try:
        done = run_client(
            ["docker", "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise BadInput(
            f"--image {image}: docker not found: the job runs in the image with the Docker client of "
            "each node, and submit checks the image with this host's (or submit with --venv)"
        ) from None
    except subprocess.TimeoutExpired:
        raise BadInput(
            f"--image {image}: docker did not answer within {_TIMEOUT_S} s: is dockerd running?"
        ) from None
    if done.returncode != 0:
        detail = " ".join((done.stderr or done.stdout or "").split()) or f"exit code {done.returncode}"
        if "no such image" in detail.lower():
            detail = "Docker on this host has no such image (build it with docker/build-image.sh, or load it)"
        raise BadInput(f"--image {image}: {detail}")


def _mountable(path: Path, what: str) -> str:
    """``path`` as the source of a `docker run -v`; BadInput for a path one -v cannot carry."""
    if ":" in str(path) or "\n" in str(path):
        raise BadInput(
            f"{what} {path}: a path with a colon or a newline cannot be mounted with docker run -v"
        )
    return str(path)


def image_command(flags: RunFlags, config: Config, image: str, cpus: int, mem_mib: int) -> str:
    """The job's `docker run` with ``--image``: ``bigmem-train remote start``'s (hardened, the job's user, no
    network), in the foreground, removed when it ends, tini as its PID 1 (it passes SIGTERM on, and the exit
    code back); the results folder at /results, the config file at /config/job.yaml and the dataset the
    config names at /data, read-only; the job's CPUs as its --cpus. The container is Docker's child, not the
    job's, so Slurm's cgroup does not hold it: its own cgroup does, with the job's --mem (``mem_mib``) as its
    --memory and no swap beyond it, the limit the job's preflight and memory guard then read as they would
    Slurm's."""
    from bigmem_train.ops.hosts import JOB_NAME
    from bigmem_train.ops.remote import docker_run_command

    if not JOB_NAME.match(flags.run_name):
        raise BadInput(
            f"--run-name {flags.run_name}: with --image the run name is the container's name: use letters, "
            "digits, '.', '_' and '-'"
        )
    config_file = Path(flags.config) if flags.config and Path(flags.config).is_file() else None
    data = None
    if config.data.source == "decathlon" and config.data.path is not None:
        data = _mountable(Path(config.data.path).resolve(), "the dataset")
    # A preset is named, not mounted; --set and --target go in as given.
    run_flags = ["--config", flags.config] if flags.config and config_file is None else []
    for text in flags.overrides:
        run_flags += ["--set", text]
    if flags.target:
        run_flags += ["--target", flags.target]
    memory = f"{mem_mib}m"
    options = ["--rm", "--init", "--cpus", str(cpus), "--memory", memory, "--memory-swap", memory]
    # numactl binds memory and cores on a node of several NUMA nodes, which the script finds there ($numa).
    options.append("${numa:+--cap-add SYS_NICE}")
    for name in _SLURM_VARIABLES:
        options += ["-e", name]
    return docker_run_command(
        flags.run_name,
        image,
        flags.results,
        flags.run_name,
        data,
        {},
        config=None if config_file is None else shlex.quote(_mountable(config_file, "--config")),
        results=shlex.quote(_mountable(Path(flags.results), "the results folder")),
        detach=False,
        options=options,
        run_flags=run_flags,
    )


def batch_script(
    plan: JobPlan,
    partition: Partition,
    command: str,
    job_name: str,
    output: Path,
    time: str | None,
    cpus: int,
    workdir: Path,
    nodes: int = 1,
    container: str | None = None,
) -> str:
    """The rendered batch script (``templates/slurm_job.sh.j2``): one task on one node, or for a
    multi_worker job one worker on each of ``nodes`` nodes, started by srun. ``command``: the job's command
    line (shell); ``container``: its container's name when ``command`` is a `docker run`."""
    for path in (output, workdir):
        # The #SBATCH lines quote paths (a space is common); sbatch has no escape for a quote inside.
        if '"' in str(path) or "\n" in str(path):
            raise BadInput(f"{path}: a path with a double quote or a newline cannot go into an #SBATCH line")
    return render(
        TEMPLATE,
        {
            "job_name": job_name,
            "partition": partition.name,
            "mem_mib": mem_request_mib(plan),
            "cpus_per_task": cpus,
            "multi_worker": plan.config.training.strategy == "multi_worker",
            "nodes": nodes,
            "time_limit": time or "",
            "output": str(output),
            # A folder beside the log for the workers' exit codes (the script appends the job id).
            "exit_codes": shlex.quote(str(output.parent / f".{job_name}.slurm-exit")),
            "workdir": str(workdir),
            "command": command,
            "container": container or "",
            "plan_line": plan_line(plan),
        },
    )


def plan_line(plan: JobPlan) -> str:
    """The plan behind --mem, in one line."""
    config = plan.config
    batch = f"batch {config.training.batch_size}"
    if config.training.strategy == "multi_worker":
        batch += f" over {plan.workers} worker(s), {config.training.batch_size // plan.workers} per node"
    return (
        f"plan: peak {format_bytes(plan.peak_bytes)} -> --mem={mem_request_mib(plan)}M; "
        f"{batch}, input {'x'.join(map(str, config.data.input_shape))}, "
        f"calibration {plan.calibration_source or 'built-in'}"
    )


def submit(script: str) -> str:
    """``sbatch --parsable`` the script (on stdin); the job id."""
    answer = _slurm(["sbatch", "--parsable"], stdin=script).strip()
    job_id = answer.split(";")[0]
    if not job_id.isdigit():
        raise BadInput(f"sbatch: unexpected answer {answer!r}")
    return job_id


def _cpus_for(config_threads: int | None, host_cores: int, partition: Partition) -> int:
    return max(1, min(config_threads or host_cores, partition.cpus_per_node))


def check_image_job(image: str, strategy: str) -> None:
    """BadInput unless a job of ``strategy`` can run in ``image`` and Docker here knows the image."""
    if strategy == "multi_worker":
        # Each worker builds its TF_CONFIG with scontrol, which the image lacks, and on a host network.
        raise BadInput(
            f"--image {image}: a training.strategy multi_worker job runs from the venv only for now "
            "(its workers build TF_CONFIG with scontrol, which the image lacks): submit it with --venv"
        )
    check_image(image)


def submit_job(
    config: Config,
    flags: RunFlags,
    partition_name: str | None,
    time: str | None,
    dry_run: bool,
    print_line: Callable[[str], None] = print,
    nodes: int = 1,
    image: str | None = None,
) -> int:
    """``bigmem-train submit``: plan, check against the partition, render, and submit (or print).

    ``config`` is the job as ``run`` will load it (with the command line's overrides); ``flags`` are the
    flags the job's ``bigmem-train run`` gets (config, overrides, results, run name). ``image``: run the job
    in this Docker image on the node, not this environment's bigmem-train."""
    from bigmem_train.host import read_host_facts
    from bigmem_train.memory.plan import plan_job

    time = check_time(time) if time else None
    check_nodes(nodes, config.training.strategy)
    if image:
        check_image_job(image, config.training.strategy)
    partition = read_partition(partition_name)
    check_nodes_in_partition(nodes, partition)
    host = read_host_facts()
    # Planned for the partition's nodes, not this host: a percent target is still of this host's memory.
    # A multi_worker job is planned per node, as one of its workers.
    multi_worker = config.training.strategy == "multi_worker"
    plan = plan_job(config, host, to_run_here=False, workers=nodes if multi_worker else None)
    check_fits_partition(plan, partition, nodes)
    results = Path(config.output.results_dir).resolve()
    run_name = config.output.run_name
    cpus = _cpus_for(config.runtime.intra_op_threads, host.physical_cores, partition)
    if image:
        command = image_command(flags, config, image, cpus, mem_request_mib(plan))
    else:
        command = venv_command(flags)
    script = batch_script(
        plan,
        partition,
        command,
        job_name=run_name,
        # Beside the run directory: `run` refuses a run directory holding files it did not write.
        output=results / f"{run_name}.slurm-%j.out",
        time=time,
        cpus=cpus,
        workdir=Path.cwd(),
        nodes=nodes,
        container=run_name if image else None,
    )
    if dry_run:
        print_line(script.rstrip("\n"))
        print_line(plan_line(plan))
        return 0
    # Made here, by the submitting user: a folder docker run -v had to make would be root's.
    results.mkdir(parents=True, exist_ok=True)
    job_id = submit(script)
    print_line(job_id)
    return 0


# --------------------------------------------------------------------------------------------------
# A worker of a multi-node job: ``bigmem-train slurm tf-config`` in each task srun starts


def worker_port(job_id: int) -> int:
    """The TCP port of every worker of Slurm job ``job_id`` (WORKER_PORT_BASE + the id modulo the span)."""
    return WORKER_PORT_BASE + job_id % WORKER_PORT_SPAN


def node_addresses(names: Sequence[str]) -> dict[str, str]:
    """Each node's NodeAddr (``scontrol show node -o``): the address Slurm itself reaches it at, the node's
    name unless slurm.conf sets another."""
    text = _slurm(["scontrol", "show", "node", "-o", ",".join(names)])
    addresses = {}
    for line in text.splitlines():
        fields = dict(part.partition("=")[::2] for part in line.split() if "=" in part)
        if fields.get("NodeName"):
            addresses[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return addresses


def slurm_tf_config(environ: Mapping[str, str] | None = None) -> str:
    """TF_CONFIG for this task of a multi-node job, from Slurm's environment: the step's nodes in Slurm's
    order (``scontrol show hostnames``), each at its NodeAddr and the job's port, and SLURM_PROCID as this
    worker's index, rendered from ``templates/tf_config.json.j2``. BadInput (one line) outside an srun step
    of one task per node."""
    environ = os.environ if environ is None else environ
    numbers = ("SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_NODEID")
    missing = [name for name in numbers if not environ.get(name, "").strip().isdigit()]
    missing += [] if environ.get("SLURM_STEP_NODELIST", "").strip() else ["SLURM_STEP_NODELIST"]
    if missing:
        raise BadInput(
            f"slurm tf-config: {', '.join(missing)} not set: run it in a task that srun starts, inside the job"
        )
    job_id, tasks, rank, node = (int(environ[name]) for name in numbers)
    nodelist = environ["SLURM_STEP_NODELIST"].strip()
    hosts = _slurm(["scontrol", "show", "hostnames", nodelist]).split()
    if tasks != len(hosts) or rank != node:
        # Worker i's address is the i-th node's: task i must run there, alone.
        raise BadInput(
            f"slurm tf-config: task {rank} of {tasks} on node {node} of {nodelist}: a multi-worker job runs "
            "one task per node (srun --ntasks-per-node=1)"
        )
    addresses = node_addresses(hosts)
    # The template Ansible and `remote` render TF_CONFIG with, the job's nodes as its inventory group.
    hostvars = {
        name: {
            "bigmem_train_worker_address": addresses.get(name, name),
            "bigmem_train_worker_port": worker_port(job_id),
        }
        for name in hosts
    }
    return render_tf_config({"slurm": hosts}, hostvars, hosts[rank], "slurm")


# --------------------------------------------------------------------------------------------------
# A submitted job: ``bigmem-train slurm status|logs|stop|fetch JOB``

# Slurm's job states after which the job holds no resources any more (verdict/postmortem.py reads them too).
ENDED = SLURM_ENDED
# scontrol prints these fields alone on their line, with any spaces the value has.
_WHOLE_LINE_FIELDS = ("Command=", "WorkDir=", "StdErr=", "StdIn=", "StdOut=", "Comment=")
_STOP_WAIT_S = 60


@dataclass(frozen=True)
class SlurmJob:
    """A job ``submit`` made: its id, its run (name and directory on the shared results folder), its log
    (``RESULTS/NAME.slurm-JOBID.out``) and what ``scontrol show job`` says ({} once Slurm forgot it)."""

    job_id: str
    run_name: str
    run_dir: Path
    log: Path
    fields: dict[str, str]

    @property
    def state(self) -> str | None:
        """Slurm's JobState (``RUNNING``, ``FAILED``, ...); None when Slurm no longer lists the job."""
        return self.fields.get("JobState") or None

    @property
    def active(self) -> bool:
        return self.state is not None and self.state not in ENDED


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job JOBID`` as a dict; {} when Slurm does not know the job (never did, or it ended
    longer ago than the cluster's MinJobAge)."""
    text = _slurm(["scontrol", "show", "job", job_id], unknown="Invalid job id")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(_WHOLE_LINE_FIELDS):
            key, _, value = line.partition("=")
            fields[key] = value
            continue
        for part in line.split():
            key, _, value = part.partition("=")
            fields.setdefault(key, value)
    return fields


def find_job(reference: str, results_dir: Path) -> SlurmJob:
    """The job ``reference`` names: a job id, or a run name (its newest job). Slurm says where its log and
    run directory are while it lists the job; after that, the log's name in ``results_dir`` does."""
    results_dir = Path(results_dir)
    if reference.isdigit():
        job_id = reference
    else:
        listed = _slurm(["squeue", "-h", "-t", "all", "--name", reference, "-o", "%i"]).split()
        logged = [
            path.name.removeprefix(f"{reference}.slurm-").removesuffix(".out")
            for path in results_dir.glob(f"{glob.escape(reference)}.slurm-*.out")
        ]
        ids = [job_id for job_id in [*listed, *logged] if job_id.isdigit()]
        if not ids:
            raise BadInput(
                f"no Slurm job named {reference}: squeue lists none and {results_dir} has no "
                f"{reference}.slurm-JOBID.out (give the results folder with --results)"
            )
        job_id = max(ids, key=int)
    fields = show_job(job_id)
    if fields:
        name, log = fields.get("JobName", ""), Path(fields.get("StdOut", ""))
        if log.name != f"{name}.slurm-{job_id}.out":
            raise BadInput(
                f"Slurm job {job_id} ({name}) was not submitted by bigmem-train submit (its output is {log})"
            )
        return SlurmJob(job_id, name, log.parent / name, log, fields)
    found = sorted(results_dir.glob(f"*.slurm-{job_id}.out"))
    if not found:
        raise BadInput(
            f"Slurm job {job_id}: Slurm no longer lists it and {results_dir} has no *.slurm-{job_id}.out "
            f"(give the results folder with --results)"
        )
    name = found[0].name.removesuffix(f".slurm-{job_id}.out")
    return SlurmJob(job_id, name, results_dir / name, found[0], {})


def run_progress(run_dir: Path, running: bool) -> dict[str, Any]:
    """What the run directory says of the run: its state, epoch and step, last epoch, memory, verdict
    (the keys :func:`bigmem_train.ops.status.format_status` shows)."""
    from bigmem_train.verdict.rundir import read_history, read_memory_csv, read_record, read_state

    if not run_dir.is_dir():
        return {}
    state = read_state(run_dir)
    report: dict[str, Any] = {"run_state": state.get("state"), "error": state.get("error")}
    if state.get("stopped") == "memory":
        report["error"] = state.get("message")
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        report["epochs"] = int(config["training"]["epochs"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        report["epochs"] = None
    progress = read_record(run_dir / "progress.json")
    if progress:
        report["epoch"] = int(progress.get("epoch", 0)) + 1
        report["step"] = progress.get("step")
        report["steps_per_epoch"] = progress.get("steps_per_epoch")
    history = read_history(run_dir / "history.csv")
    if history:
        report["last_epoch"] = history[-1]
    rss = [row["rss_bytes"] for row in read_memory_csv(run_dir / "memory.csv") if "rss_bytes" in row]
    peak = max([*rss, float(read_record(run_dir / "metrics.json").get("peak_rss_bytes") or 0)])
    if peak:
        report["peak_rss_bytes"] = int(peak)
        report["live_rss_bytes"] = int(rss[-1]) if running and rss else 0
    verdict = read_record(run_dir / "verdict.json")
    if verdict:
        report["verdict"] = verdict.get("verdict")
    return report


def job_status(job: SlurmJob) -> dict[str, Any]:
    """Slurm's view of the job (state, reason, node, exit code) and its run directory's (see run_progress)."""
    exit_code, _, signal = job.fields.get("ExitCode", "").partition(":")
    reason = job.fields.get("Reason")
    report: dict[str, Any] = {
        "job_id": job.job_id,
        "name": job.run_name,
        "state": job.state,
        "reason": None if reason in (None, "", "None") else reason,
        "host": job.fields.get("BatchHost") or None,
        "exit_code": int(exit_code) if job.state in ENDED and exit_code.isdigit() else None,
        "signal": int(signal) if signal.isdigit() and int(signal) else None,
        "run_dir": str(job.run_dir),
        "log": str(job.log),
    }
    report.update(run_progress(job.run_dir, running=job.state == "RUNNING"))
    return report


def format_job_status(report: dict[str, Any]) -> str:
    """The status as text: Slurm's line, then the run's lines as ``bigmem-train remote status`` shows them."""
    from bigmem_train.ops.status import format_status

    state = report["state"] or "no longer listed by Slurm (see sacct)"
    if report.get("reason"):
        state += f" ({report['reason']})"
    if report.get("host"):
        state += f" on {report['host']}"
    if report.get("exit_code") is not None:
        state += f", exit code {report['exit_code']}"
    if report.get("signal"):
        state += f", signal {report['signal']}"
    # format_status's first line names a host and the remote job's state; Slurm's line replaces it.
    run_lines = format_status({**report, "exit_code": None}).splitlines()[1:]
    return "\n".join(
        [f"{report['name']}: Slurm job {report['job_id']} {state}", *run_lines, f"  log: {report['log']}"]
    )


def job_logs(
    job: SlurmJob,
    follow: bool = False,
    lines: int | None = None,
    write: Callable[[str], Any] | None = None,
    poll_s: float = 1.0,
) -> int:
    """Print the job's output file (the last ``lines``); with ``follow``, until Slurm says the job ended."""
    write = write or sys.stdout.write
    while not job.log.exists():
        if not (follow and job.active):
            print(
                f"{job.run_name}: Slurm job {job.job_id} is {job.state or 'not listed'}; no output yet ({job.log})",
                file=sys.stderr,
            )
            return 0
        sleep(poll_s)
        job = replace(job, fields=show_job(job.job_id))
    with open(job.log, errors="replace") as handle:
        text = handle.read()
        if lines is not None:
            text = "".join(text.splitlines(keepends=True)[-lines:] if lines > 0 else [])
        write(text)
        while follow and job.active:
            sleep(poll_s)
            job = replace(job, fields=show_job(job.job_id))
            write(handle.read())
        sys.stdout.flush()
    return 0


def stop_job(job: SlurmJob, wait_s: float = _STOP_WAIT_S) -> str:
    """``scancel`` the job (Slurm sends SIGTERM, then SIGKILL after its KillWait) and wait for it to end.
    Its run directory stays: submitting the same config and run name again resumes it from its last epoch."""
    if not job.active:
        return f"{job.run_name}: Slurm job {job.job_id} is not running ({job.state or 'no longer listed'})"
    _slurm(["scancel", job.job_id])
    deadline = monotonic() + wait_s
    while job.active and monotonic() < deadline:
        sleep(0.5)
        job = replace(job, fields=show_job(job.job_id))
    ended = job.state if not job.active else f"{job.state}, still ending"
    return (
        f"{job.run_name}: Slurm job {job.job_id} cancelled ({ended}); "
        f"submit it again with the same config and --run-name {job.run_name} to resume it"
    )


def fetch_job(job: SlurmJob, to_dir: Path, checkpoints: bool = True) -> Path:
    """Copy the job's run directory (without the transient backup/) and its log (as job.log) into
    ``to_dir/RUN_NAME``, as ``bigmem-train remote fetch`` does."""
    if not job.run_dir.is_dir():
        raise BadInput(f"Slurm job {job.job_id} has no run directory yet ({job.run_dir})")
    destination = Path(to_dir).expanduser() / job.run_name
    if destination.resolve() == job.run_dir.resolve():
        raise BadInput(f"--to {to_dir}: that is where the run directory is already")
    skip = {"backup"} | (set() if checkpoints else {"checkpoints"})
    top = str(job.run_dir)
    shutil.copytree(
        job.run_dir,
        destination,
        ignore=lambda folder, names: [name for name in names if folder == top and name in skip],
        dirs_exist_ok=True,
    )
    if job.log.is_file():
        shutil.copyfile(job.log, destination / "job.log")
    return destination
