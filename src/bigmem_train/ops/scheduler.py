"""Slurm: submit a planned job with its plan as the memory request (``bigmem-train submit``).

The batch script is rendered from ``templates/slurm_job.sh.j2``; ``#SBATCH --mem`` is the plan's envelope
peak with the 3 % it promises no run passes, rounded up to MiB, so the scheduler places the job only where
that much memory is free and runs the next job beside it only when both fit. A plan larger than the
partition's nodes (``sinfo`` RealMemory) is refused before anything is submitted.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bigmem_train.config import Config
from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.memory.constants import PLAN_COVERAGE
from bigmem_train.memory.plan import JobPlan
from bigmem_train.ops.render import render
from bigmem_train.sizes import format_bytes

MIB = 1024**2
TEMPLATE = "slurm_job.sh.j2"
# Slurm's --time formats (sbatch(1)): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, and UNLIMITED.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
_TIMEOUT_S = 15


def run_client(command: list[str], **options) -> subprocess.CompletedProcess:
    """Run one Slurm client command (the tests replace this with a stand-in for sinfo and sbatch)."""
    return subprocess.run(command, **options)


@dataclass(frozen=True)
class Partition:
    """A partition as ``sinfo`` shows it: its largest node's memory (RealMemory, MiB) and CPUs."""

    name: str
    node_memory_mib: int
    cpus_per_node: int
    nodes: int


def check_time(text: str) -> str:
    """``text`` if it is one of Slurm's --time formats, else BadInput."""
    value = text.strip()
    if value.upper() in {"UNLIMITED", "INFINITE"} or _TIME.match(value):
        return value
    raise BadInput(
        f"--time {text!r}: not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)"
    )


def mem_request_mib(plan: JobPlan) -> int:
    """``#SBATCH --mem`` in MiB: the plan's envelope peak with the coverage it promises (no run more than
    PLAN_COVERAGE above it), rounded up: under memory enforcement a run that ends within its plan's promise
    must not be killed."""
    return math.ceil(plan.peak_bytes * (1 + PLAN_COVERAGE) / MIB)


def _slurm(command: Sequence[str], stdin: str | None = None) -> str:
    """Run a Slurm client; BadInput (one line) when it is missing, hangs or fails."""
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
    if done.returncode != 0:
        detail = " ".join((done.stderr or done.stdout or "").split()) or f"exit code {done.returncode}"
        raise BadInput(f"{' '.join(command[:2])}: {detail}")
    return done.stdout


def read_partition(name: str | None) -> Partition:
    """The partition ``name`` (default: the cluster's default partition) from ``sinfo``."""
    command = ["sinfo", "-h", "-o", "%P %m %c %D"]
    if name:
        command += ["-p", name]
    lines = [line.split() for line in _slurm(command).splitlines() if line.strip()]
    if name:
        rows = [row for row in lines if row[0].rstrip("*") == name]
        if not rows:
            raise BadInput(f"--partition {name}: no such partition (sinfo shows: {_names()})")
    else:
        rows = [row for row in lines if row[0].endswith("*")]
        if not rows:
            raise BadInput("no default partition in this cluster: name one with --partition")
    try:
        # A line per node state; "4000+" when the nodes of one line differ. The largest node decides
        # whether the job can run at all.
        memory = max(int(row[1].rstrip("+")) for row in rows)
        cpus = max(int(row[2].rstrip("+")) for row in rows)
        nodes = sum(int(row[3]) for row in rows)
    except (IndexError, ValueError):
        raise BadInput(f"sinfo: unexpected output {' | '.join(' '.join(row) for row in rows)!r}") from None
    return Partition(rows[0][0].rstrip("*"), memory, cpus, nodes)


def _names() -> str:
    try:
        text = _slurm(["sinfo", "-h", "-o", "%P"])
    except BadInput:
        return "?"
    return ", ".join(sorted({line.strip() for line in text.splitlines() if line.strip()})) or "none"


def check_fits_partition(plan: JobPlan, partition: Partition) -> None:
    """DoesNotFit (exit 3) when the plan's memory request exceeds the partition's largest node."""
    request = mem_request_mib(plan)
    if request > partition.node_memory_mib:
        raise DoesNotFit(
            f"the plan ({format_bytes(plan.peak_bytes)}, --mem={request}M) does not fit partition "
            f"{partition.name}: its largest node has RealMemory {partition.node_memory_mib}M "
            f"({format_bytes(partition.node_memory_mib * MIB)})"
        )


def bigmem_train_executable() -> Path:
    """The ``bigmem-train`` of this environment (beside the running Python), as the job should run it."""
    return Path(sys.executable).parent / "bigmem-train"


def batch_script(
    plan: JobPlan,
    partition: Partition,
    run_arguments: Sequence[str],
    job_name: str,
    output: Path,
    time: str | None,
    cpus: int,
    workdir: Path,
) -> str:
    """The rendered batch script (``templates/slurm_job.sh.j2``)."""
    return render(
        TEMPLATE,
        {
            "job_name": job_name,
            "partition": partition.name,
            "mem_mib": mem_request_mib(plan),
            "cpus_per_task": cpus,
            "time_limit": time or "",
            "output": str(output),
            "workdir": str(workdir),
            "command": shlex.join([str(bigmem_train_executable()), "run", *run_arguments]),
            "plan_line": plan_line(plan),
        },
    )


def plan_line(plan: JobPlan) -> str:
    """The plan behind --mem, in one line."""
    config = plan.config
    return (
        f"plan: peak {format_bytes(plan.peak_bytes)} -> --mem={mem_request_mib(plan)}M; "
        f"batch {config.training.batch_size}, input {'x'.join(map(str, config.data.input_shape))}, "
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


def submit_job(
    config: Config,
    run_arguments: Sequence[str],
    partition_name: str | None,
    time: str | None,
    dry_run: bool,
    print_line: Callable[[str], None] = print,
) -> int:
    """``bigmem-train submit``: plan, check against the partition, render, and submit (or print).

    ``config`` is the job as ``run`` will load it (with the command line's overrides); ``run_arguments``
    are the flags the job's ``bigmem-train run`` gets (config, overrides, results, run name)."""
    from bigmem_train.host import read_host_facts
    from bigmem_train.memory.plan import plan_job

    time = check_time(time) if time else None
    host = read_host_facts()
    # Planned for the partition's nodes, not this host: a percent target is still of this host's memory.
    plan = plan_job(config, host, to_run_here=False)
    partition = read_partition(partition_name)
    check_fits_partition(plan, partition)
    results = Path(config.output.results_dir).resolve()
    run_name = config.output.run_name
    script = batch_script(
        plan,
        partition,
        run_arguments,
        job_name=run_name,
        # Beside the run directory: `run` refuses a run directory holding files it did not write.
        output=results / f"{run_name}.slurm-%j.out",
        time=time,
        cpus=_cpus_for(config.runtime.intra_op_threads, host.physical_cores, partition),
        workdir=Path.cwd(),
    )
    if dry_run:
        print_line(script.rstrip("\n"))
        print_line(plan_line(plan))
        return 0
    results.mkdir(parents=True, exist_ok=True)
    job_id = submit(script)
    print_line(job_id)
    return 0
