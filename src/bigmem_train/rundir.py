"""The run directory: one folder per job, a state file, and the checks that keep finished runs safe."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

from .config import Config
from .errors import BadInput

STATE_FILE = "state.json"
RUNNING, FINISHED, FAILED = "running", "finished", "failed"


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename), so a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(temporary, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{path} is not valid JSON") from None


def read_state(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / STATE_FILE
    return read_json(path) if path.exists() else {}


def set_state(run_dir: Path, state: str, **extra: Any) -> None:
    current = read_state(run_dir)
    current.update(extra, state=state, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    current.setdefault("started", current["updated"])
    if state == FINISHED:
        current["finished"] = current["updated"]
    write_json(Path(run_dir) / STATE_FILE, current)


def ensure_writable(folder: Path) -> None:
    """Create ``folder`` if needed and check this user can write there; one clear line otherwise."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except PermissionError:
        raise BadInput(f"results folder {folder} cannot be created by uid {os.getuid()}: permission denied") from None
    except OSError as error:
        raise BadInput(f"results folder {folder} cannot be created: {error.strerror}") from None
    if not folder.is_dir():
        raise BadInput(f"results folder {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        owner = folder.stat().st_uid
        raise BadInput(
            f"results folder {folder} is not writable by uid {os.getuid()} (owned by uid {owner}); "
            f"chown it to {os.getuid()} or run with --user {owner}"
        )


def prepare_run_dir(config: Config) -> tuple[Path, bool]:
    """Create or reopen the run directory; returns (path, resuming).

    A named run that exists unfinished is resumed if its config matches; a finished one is never
    overwritten.
    """
    results = Path(config.output.results_dir)
    ensure_writable(results)
    name = config.output.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = results / name
    resolved = config.to_yaml()
    if run_dir.exists():
        state = read_state(run_dir).get("state")
        if state == FINISHED:
            raise BadInput(f"run {run_dir} already finished; choose another --run-name (it is kept as it is)")
        saved = run_dir / "config.yaml"
        if saved.exists() and saved.read_text() != resolved:
            raise BadInput(f"run {run_dir} exists with a different config; choose another --run-name")
        if not (run_dir / STATE_FILE).exists() and any(run_dir.iterdir()):
            raise BadInput(f"{run_dir} exists and is not a bigmem-train run; choose another --run-name")
        resuming = (run_dir / "backup").exists()
    else:
        if config.output.run_name is None:
            # Two runs started in the same second get distinct folders.
            suffix = 1
            while run_dir.exists():
                suffix += 1
                run_dir = results / f"{name}-{suffix}"
        run_dir.mkdir(parents=True)
        resuming = False
    (run_dir / "config.yaml").write_text(resolved)
    set_state(run_dir, RUNNING, pid=os.getpid())
    return run_dir, resuming


# Readers of the files a run writes (history.csv by Keras' CSVLogger, steps.csv by train.StepTimer,
# memory.csv by monitor.MemorySampler), shared by train, validate and report.


def read_history(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            parsed = {}
            for key, value in row.items():
                try:
                    parsed[key] = float(value)
                except (TypeError, ValueError):
                    continue
            rows.append(parsed)
    return rows


def read_step_seconds(path: Path) -> list[float]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return [float(row["seconds"]) for row in csv.DictReader(handle)]


def read_memory_csv(path: Path) -> list[dict[str, float]]:
    """Rows of a memory.csv as floats (for validation and the report)."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as handle:
        return [{key: float(value) for key, value in row.items() if value not in (None, "")}
                for row in csv.DictReader(handle)]
