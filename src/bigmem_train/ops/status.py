"""``bigmem-train remote status``: one round trip reads a job's files on its host; the report and its text."""

from __future__ import annotations

import json
import shlex
from typing import Any

from bigmem_train.errors import BadInput
from bigmem_train.ops.hosts import (
    DEFAULT_CONNECT_TIMEOUT,
    Inventory,
    RemoteHost,
    _run,
    check_job_name,
    connect,
    job_dir,
)
from bigmem_train.sizes import format_bytes


def _read_job(connection: Any, host: RemoteHost, name: str, required: bool = True) -> dict[str, Any] | None:
    check_job_name(name)
    result = _run(connection, f"cat {shlex.quote(job_dir(host, name))}/job.json")
    if result.exited != 0:
        if required:
            raise BadInput(f"no job named {name} on {host.name} (looked for {job_dir(host, name)})")
        return None
    try:
        job = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise BadInput(f"{job_dir(host, name)}/job.json on {host.name} is not valid JSON") from None
    job["folder"] = job_dir(host, name)
    return job


def _is_running(connection: Any, job: dict[str, Any]) -> bool:
    if job.get("mode") == "docker":
        result = _run(
            connection, f"docker inspect -f '{{{{.State.Running}}}}' {shlex.quote(job['container'])}"
        )
        return result.stdout.strip() == "true"
    folder = shlex.quote(job["folder"])
    result = _run(connection, f"kill -0 {int(job['pid'])} 2>/dev/null && [ ! -e {folder}/exit_code ]")
    return result.exited == 0


# One round trip reads everything status shows; sections are split on "@@name" lines.
_STATUS_SCRIPT = r"""
cd {folder} || exit 3
run={run_dir}
section() {{ echo "@@$1"; }}
section exit_code; cat exit_code 2>/dev/null
section state; cat "$run/state.json" 2>/dev/null
section progress; cat "$run/progress.json" 2>/dev/null
section history; head -n 1 "$run/history.csv" 2>/dev/null; tail -n 1 "$run/history.csv" 2>/dev/null
section steps; tail -n 1 "$run/steps.csv" 2>/dev/null
section memory
[ -s "$run/memory.csv" ] && awk -F, 'NR == 1 {{ for (i = 1; i <= NF; i++) if ($i == "rss_bytes") c = i; next }}
  c && $c + 0 > peak {{ peak = $c + 0 }} c {{ live = $c }} END {{ if (c) printf "%.0f %.0f\n", live, peak }}' "$run/memory.csv"
section config_epochs; awk '/^training:/ {{ t = 1; next }} /^[^ ]/ {{ t = 0 }} t && $1 == "epochs:" {{ print $2 }}' "$run/config.yaml" 2>/dev/null
section verdict; cat "$run/verdict.json" 2>/dev/null
section metrics; cat "$run/metrics.json" 2>/dev/null
section memory_last; head -n 1 "$run/memory.csv" 2>/dev/null; tail -n 1 "$run/memory.csv" 2>/dev/null
section plan_peak; grep -o '"peak_bytes": [0-9]*' "$run/plan.json" 2>/dev/null | head -n 1 | tr -dc 0-9; echo
section host_oom; awk '$1 == "oom_kill" {{ print $2 }}' /proc/vmstat 2>/dev/null
section cgroup_oom
counter=$(sed -n 's/.*"oom_counter_file": "\([^"]*\)".*/\1/p' "$run/state.json" 2>/dev/null | head -n 1)
[ -n "$counter" ] && [ -z {container} ] && awk '$1 == "oom_kill" {{ print $2 }}' "$counter" 2>/dev/null
section predict; cat "$run/predict.json" 2>/dev/null
section evaluation; cat "$run/evaluation.json" 2>/dev/null
section container
[ -n {container} ] && docker inspect -f '{{{{.State.OOMKilled}}}} {{{{.State.ExitCode}}}}' {container} 2>/dev/null
true
"""


def _sections(text: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("@@"):
            current = line[2:].strip()
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return {key: value.strip() for key, value in sections.items()}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


def status(
    inventory: Inventory, target: str, name: str, timeout: float = DEFAULT_CONNECT_TIMEOUT
) -> list[dict[str, Any]]:
    """Status of a job on a host (or on every worker of a group), read from the run's own files."""
    reports = []
    for host in inventory.targets(target):
        with connect(host, timeout) as connection:
            reports.append(_status_on(connection, host, name))
    return reports


def _status_on(connection: Any, host: RemoteHost, name: str) -> dict[str, Any]:
    job = _read_job(connection, host, name)
    running = _is_running(connection, job)
    container = job.get("container") if job.get("mode") == "docker" else ""
    script = _STATUS_SCRIPT.format(
        folder=shlex.quote(job["folder"]),
        run_dir=shlex.quote(job["run_dir"]),
        container=shlex.quote(container or ""),
    )
    sections = _sections(_run(connection, script).stdout)
    if job.get("command") == "predict":
        return _predict_report(host, name, job, running, sections)
    state_file = _json_or_none(sections.get("state", "")) or {}
    progress = _json_or_none(sections.get("progress", "")) or {}
    exit_code = sections.get("exit_code") or None
    if running:
        state = "running"
    elif job.get("stopped"):
        state = "stopped"
    elif state_file.get("state") in {"finished", "failed"}:
        state = state_file["state"]
    elif job.get("mode") == "process" and exit_code is None:
        state = "gone"  # killed without writing its exit code
    else:
        state = "exited"
    report: dict[str, Any] = {
        "host": host.name,
        "name": name,
        "command": "run",
        "state": state,
        "mode": job.get("mode"),
        "run_dir": f"{job['folder']}/{job['run_dir']}",
        "started": job.get("started"),
        "run_state": state_file.get("state"),
        "error": state_file.get("error"),
        "exit_code": _integer(exit_code),
    }
    epochs = sections.get("config_epochs")
    report["epochs"] = int(epochs) if epochs and epochs.isdigit() else None
    if progress:
        report["epoch"] = int(progress.get("epoch", 0)) + 1
        report["step"] = progress.get("step")
        report["steps_per_epoch"] = progress.get("steps_per_epoch")
    elif sections.get("steps") and not sections["steps"].startswith("epoch"):
        fields = sections["steps"].split(",")
        report["epoch"], report["step"] = int(fields[0]) + 1, int(fields[1]) + 1
    history = sections.get("history", "").splitlines()
    if len(history) == 2 and history[0] != history[1]:
        last = dict(zip(history[0].split(","), history[1].split(",")))
        report["last_epoch"] = {key: _number(value) for key, value in last.items()}
    memory = sections.get("memory", "").split()
    if len(memory) == 2:
        report["live_rss_bytes"], report["peak_rss_bytes"] = int(memory[0]), int(memory[1])
        if not running:
            report["live_rss_bytes"] = 0
    verdict = _json_or_none(sections.get("verdict", ""))
    if verdict:
        report["verdict"] = verdict.get("verdict")
    metrics = _json_or_none(sections.get("metrics", ""))
    if metrics and metrics.get("peak_rss_bytes"):
        report["peak_rss_bytes"] = max(report.get("peak_rss_bytes", 0), int(metrics["peak_rss_bytes"]))
    if state_file.get("stopped") == "memory":
        report["state"] = "stopped"
        report["error"] = state_file.get("message")
    if not running and state_file.get("state") == "running":
        ending = _ending(state_file, sections, report.get("exit_code"))
        report["state"] = "killed" if ending.cause in {"oom", "killed"} else report["state"]
        report["ending"] = ending.to_dict()
        report["error"] = ending.message + (f" ({ending.evidence})" if ending.evidence else "")
    return report


def _predict_report(
    host: RemoteHost, name: str, job: dict[str, Any], running: bool, sections: dict[str, str]
) -> dict[str, Any]:
    """Status of a ``remote predict`` job: the cases written so far (predict.json is rewritten after each),
    the process's peak, the evaluation's summary, and how it ended (its exit code)."""
    exit_code = _integer(sections.get("exit_code"))
    container = sections.get("container", "").split()
    if exit_code is None and not running and len(container) == 2:
        exit_code = _integer(container[1])
    if running:
        state = "running"
    elif job.get("stopped"):
        state = "stopped"
    elif exit_code is None:
        state = "gone" if job.get("mode") == "process" else "exited"
    else:
        state = "finished" if exit_code == 0 else "failed"
    report: dict[str, Any] = {
        "host": host.name,
        "name": name,
        "command": "predict",
        "state": state,
        "mode": job.get("mode"),
        "run_dir": f"{job['folder']}/{job['run_dir']}",
        "started": job.get("started"),
        "exit_code": exit_code,
        "model": job.get("model"),
        "data": job.get("data"),
        "labels": job.get("labels"),
    }
    predicted = _json_or_none(sections.get("predict", "")) or {}
    cases = predicted.get("cases") or {}
    report["cases_done"] = len(cases)
    report["cases_total"] = predicted.get("cases_total")
    peaks = [int(case["peak_rss_bytes"]) for case in cases.values() if case.get("peak_rss_bytes")]
    if peaks:
        report["peak_rss_bytes"] = max(peaks)
    evaluation = _json_or_none(sections.get("evaluation", ""))
    if evaluation:
        report["evaluation"] = evaluation.get("summary")
    return report


def _integer(text: str | None) -> int | None:
    return int(text) if text and text.strip().lstrip("-").isdigit() else None


def _ending(state_file: dict[str, Any], sections: dict[str, str], exit_code: int | None):
    """How a run whose state.json says running, and whose process is gone, ended (postmortem.explain)."""
    from bigmem_train.verdict.postmortem import explain

    container = sections.get("container", "").split()
    oom_killed = container[0] == "true" if container else None
    if len(container) == 2 and container[1].lstrip("-").isdigit():
        exit_code = int(container[1])
    measured = None
    memory = sections.get("memory_last", "").splitlines()
    if len(memory) == 2 and memory[0] != memory[1]:
        row = dict(zip(memory[0].split(","), memory[1].split(",")))
        limited = bool((state_file.get("cgroup") or {}).get("limit_bytes"))
        column = "working_set_bytes" if limited and row.get("working_set_bytes") else "rss_bytes"
        measured = _integer(row.get(column))
    return explain(
        state_file,
        measured_bytes=measured,
        planned_bytes=_integer(sections.get("plan_peak")),
        container_oom_killed=oom_killed,
        cgroup_oom_kills=_integer(sections.get("cgroup_oom")),
        host_oom_kills_now=_integer(sections.get("host_oom")),
        exit_code=exit_code,
    )


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def format_status(report: dict[str, Any]) -> str:
    lines = [
        f"{report['name']} on {report['host']}: {report['state']}"
        + (f" (exit code {report['exit_code']})" if report.get("exit_code") not in (None, 0) else "")
    ]
    if report.get("command") == "predict":
        total = f"/{report['cases_total']}" if report.get("cases_total") is not None else ""
        lines.append(f"  predicted {report.get('cases_done', 0)}{total} case(s)")
        for structure, row in (report.get("evaluation") or {}).items():
            lines.append(
                f"  evaluation {structure}: Dice mean {row['mean_dice']:.4f} (pooled {row['pooled_dice']:.4f}), "
                f"HD95 median {row['median_hd95_mm']:.2f} mm, {row['cases']} case(s)"
            )
    if report.get("epoch"):
        epochs = f"/{report['epochs']}" if report.get("epochs") else ""
        steps = f"/{report['steps_per_epoch']}" if report.get("steps_per_epoch") else ""
        lines.append(f"  epoch {report['epoch']}{epochs}, step {report.get('step')}{steps}")
    last = report.get("last_epoch")
    if last:
        shown = ", ".join(
            f"{key} {value:.4f}" for key, value in last.items() if key != "epoch" and isinstance(value, float)
        )
        lines.append(f"  last finished epoch {int(last.get('epoch', 0)) + 1}: {shown}")
    if "peak_rss_bytes" in report:
        live = format_bytes(report["live_rss_bytes"]) if report.get("live_rss_bytes") else "-"
        lines.append(f"  memory: live {live}, peak {format_bytes(report['peak_rss_bytes'])}")
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    if report.get("verdict"):
        lines.append(f"  verdict: {report['verdict']}")
    lines.append(f"  run directory: {report['run_dir']}")
    return "\n".join(lines)
