"""``bigmem-train remote predict``: segment volumes on a lab server with a model that is already there,
as a detached job that ``remote status``, ``logs``, ``stop`` and ``fetch`` operate like a training job.

The model is a run directory on the host (``--model``), or the run directory of a training job started
there with ``remote start`` (``--job``: ``REMOTE_DIR/jobs/JOB/`` and the run directory its job.json
names). The images (``--data``) and labels (``--labels``) are on the host too: nothing large crosses the
network. Every path is checked on the host and resolved to an absolute one before anything starts
(relative paths are taken from the login's home, as ssh does). With labels, ``evaluate`` scores the masks
in the same job once ``predict`` has succeeded; the job's exit code is the first that failed.

On the host::

    REMOTE_DIR/jobs/NAME/
      job.json        command predict, mode, container or pid, model, data, labels
      job.log         output of a process-mode job (a container's output is in `docker logs`)
      exit_code       written when a process-mode job ends
      results/NAME/   the masks, predict.json (written after every case) and evaluation.{json,csv,html,png}

In a container the run directory is mounted read-only at /model, the images at /data (a single image at
/data/ITS_NAME, so its case name stays), the labels at /labels, and only the job's results/ is writable.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from bigmem_train.errors import BadInput
from bigmem_train.ops.hosts import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_IMAGE,
    Inventory,
    RemoteHost,
    _put_text,
    _run,
    check_job_name,
    connect,
    job_dir,
)
from bigmem_train.ops.remote import (
    check_name_free,
    check_runner,
    detached,
    docker_run_head,
    launch,
    prepare_job_folder,
)
from bigmem_train.ops.status import _is_running, _read_job

# predict's rule (infer/source.py): a run directory holds config.yaml and one of these.
CHECKPOINTS = ("best.keras", "last.keras")


@dataclass
class PredictJobRequest:
    """What ``remote predict`` was asked for; ``model`` or ``job`` names the model."""

    name: str
    data: str
    model: str | None = None
    job: str | None = None
    labels: str | None = None
    image: str = DEFAULT_IMAGE
    docker: bool = True
    # predict's own options, as flags (cli/apply.py predict_option_flags), passed on unchanged.
    predict_flags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HostPath:
    """A path on the host, absolute, its folder's links resolved (a file keeps its own name)."""

    path: str
    is_dir: bool


@dataclass(frozen=True)
class PredictInputs:
    """The job's inputs on the host: a run directory (and a checkpoint in it, or "" for predict's choice),
    the images (a folder or one file) and the labels folder, if any."""

    run_dir: str
    checkpoint: str
    data: HostPath
    labels: str | None = None

    @property
    def model(self) -> str:
        return f"{self.run_dir}/{self.checkpoint}" if self.checkpoint else self.run_dir


def predict(
    inventory: Inventory,
    target: str,
    request: PredictJobRequest,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> dict[str, Any]:
    """Check the inputs on the host and start predict (and evaluate) detached; returns the job.json written."""
    check_job_name(request.name)
    if (request.model is None) == (request.job is None):
        raise BadInput(
            "remote predict: give either --model (a run directory on the host) or --job "
            "(a training job started there with remote start)"
        )
    if request.job is not None:
        check_job_name(request.job)
    host = inventory.host(target)
    with connect(host, timeout) as connection:
        check_name_free(connection, host, request.name, "predict")
        if request.job is not None:
            run_dir, checkpoint = job_model(connection, host, request.job)
        else:
            run_dir, checkpoint = model_on_host(connection, host, request.model or "")
        labels = None
        if request.labels:
            labels = path_on_host(connection, host, request.labels, "--labels")
            if not labels.is_dir:
                raise BadInput(f"--labels {request.labels}: not a folder on {host.name}")
        inputs = PredictInputs(
            run_dir,
            checkpoint,
            path_on_host(connection, host, request.data, "--data"),
            labels.path if labels else None,
        )
        check_runner(connection, host, request.docker)
        folder = job_dir(host, request.name)
        prepare_job_folder(connection, host, folder)
        job: dict[str, Any] = {
            "name": request.name,
            "command": "predict",
            "mode": "docker" if request.docker else "process",
            "host": host.name,
            "run_dir": f"results/{request.name}",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "multi_worker": False,
            "model": inputs.model,
            "from_job": request.job,
            "data": inputs.data.path,
            "labels": inputs.labels,
            "predict_flags": request.predict_flags,
        }
        if request.docker:
            job.update(image=request.image, container=request.name)
            command = predict_docker_command(request.name, request.image, inputs, request.predict_flags)
        else:
            command = predict_process_command(host.executable, request.name, inputs, request.predict_flags)
        job.update(launch(connection, host, folder, request.name, request.docker, command))
        _put_text(connection, json.dumps(job, indent=2) + "\n", f"{folder}/job.json")
    return job


def path_on_host(connection: Any, host: RemoteHost, path: str, flag: str) -> HostPath:
    """``path`` on the host, absolute (``test -e`` there), or BadInput naming the flag and the host."""
    spelled = path[2:] if path.startswith("~/") else path  # ssh starts in the home; "~" would stay quoted
    quoted = shlex.quote(spelled)
    script = (
        f'p={quoted}; [ -e "$p" ] || exit 1\n'
        'if [ -d "$p" ]; then echo dir; readlink -f -- "$p"\n'
        'else echo file; echo "$(readlink -f -- "$(dirname -- "$p")")/$(basename -- "$p")"; fi'
    )
    result = _run(connection, script)
    lines = result.stdout.splitlines()
    if result.exited != 0 or len(lines) != 2 or not lines[1].startswith("/"):
        raise BadInput(f"{flag} {path}: does not exist on {host.name}")
    return HostPath(lines[1], lines[0] == "dir")


def model_on_host(connection: Any, host: RemoteHost, spec: str) -> tuple[str, str]:
    """(run directory, checkpoint in it or "") for ``--model``: a run directory or RUN/checkpoints/X.keras."""
    found = path_on_host(connection, host, spec, "--model")
    if found.is_dir:
        run_dir, checkpoint = found.path, ""
    else:
        file = PurePosixPath(found.path)
        if file.parent.name != "checkpoints":
            raise BadInput(
                f"--model {spec}: a model file on {host.name} outside a run directory's checkpoints/ "
                f"(give the run directory, which holds the config the model was trained with)"
            )
        run_dir, checkpoint = str(file.parent.parent), f"checkpoints/{file.name}"
    if not _holds_model(connection, run_dir, checkpoint):
        raise BadInput(
            f"--model {spec}: not a run directory on {host.name} (one holds config.yaml and "
            f"checkpoints/best.keras or last.keras)"
        )
    return run_dir, checkpoint


def job_model(connection: Any, host: RemoteHost, name: str) -> tuple[str, str]:
    """(run directory, "") of training job ``name`` on the host, once it has a checkpoint and has stopped."""
    trained = _read_job(connection, host, name) or {}
    if trained.get("command", "run") != "run":
        raise BadInput(f"--job {name}: a {trained['command']} job on {host.name}, not a training job")
    if _is_running(connection, trained):
        raise BadInput(
            f"--job {name} is still training on {host.name}; predict once it has finished (or stop it), "
            f"or give --model with one of its checkpoints"
        )
    where = f"{trained['folder']}/{trained['run_dir']}"
    try:
        run_dir = path_on_host(connection, host, where, "--job").path
    except BadInput:
        raise BadInput(f"--job {name}: no run directory on {host.name} ({where})") from None
    if not _holds_model(connection, run_dir, ""):
        raise BadInput(
            f"--job {name}: no trained model on {host.name} yet ({where} lacks config.yaml or "
            f"a checkpoint, checkpoints/best.keras or last.keras)"
        )
    return run_dir, ""


def _holds_model(connection: Any, run_dir: str, checkpoint: str) -> bool:
    run = shlex.quote(run_dir)
    models = [checkpoint] if checkpoint else [f"checkpoints/{name}" for name in CHECKPOINTS]
    any_model = " || ".join(f"[ -f {run}/{shlex.quote(model)} ]" for model in models)
    return _run(connection, f"[ -f {run}/config.yaml ] && {{ {any_model}; }}").exited == 0


def _script(executable: str, model: str, data: str, out: str, labels: str | None, flags: list[str]) -> str:
    """predict, and with labels evaluate after it (only if predict succeeded), as one shell line."""
    quote = shlex.quote
    predict = [executable, "predict", "--model", model, "--data", data, "--out", out, *flags]
    script = " ".join(quote(part) for part in predict)
    if labels:
        evaluate = [executable, "evaluate", "--pred", out, "--labels", labels]
        script += " && " + " ".join(quote(part) for part in evaluate)
    return script


def predict_process_command(executable: str, name: str, inputs: PredictInputs, flags: list[str]) -> str:
    """The host's bigmem-train predict (and evaluate) detached in its own session, as `start` runs `run`."""
    return detached(
        _script(executable, inputs.model, inputs.data.path, f"results/{name}", inputs.labels, flags)
    )


def predict_docker_command(name: str, image: str, inputs: PredictInputs, flags: list[str]) -> str:
    """`docker run -d` of a predict job: hardened as training, no network, only results/ writable."""
    quote = shlex.quote
    data = "/data" if inputs.data.is_dir else f"/data/{PurePosixPath(inputs.data.path).name}"
    parts = [
        *docker_run_head(name),
        "--network",
        "none",
        "-v",
        f"{quote(inputs.run_dir)}:/model:ro",
        "-v",
        f"{quote(inputs.data.path)}:{quote(data)}:ro",
    ]
    if inputs.labels:
        parts += ["-v", f"{quote(inputs.labels)}:/labels:ro"]
    model = f"/model/{inputs.checkpoint}" if inputs.checkpoint else "/model"
    out = f"/results/{name}"
    if inputs.labels:
        # Two commands in one container: a shell runs them (the image's entrypoint is bigmem-train).
        script = _script("bigmem-train", model, data, out, "/labels", flags)
        parts += ["--entrypoint", "sh", quote(image), "-c", quote(script)]
    else:
        predict = ["predict", "--model", model, "--data", data, "--out", out, *flags]
        parts += [quote(image), *(quote(part) for part in predict)]
    return " ".join(parts)
