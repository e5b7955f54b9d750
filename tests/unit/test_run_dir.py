"""The run directory's rules (``verdict.rundir.prepare_run_dir``), fast: a finished run is never reopened,
a folder that is not a run is never written into, unnamed runs started in the same second get folders of
their own, a resumed run drops what its last session ended with, and the resume line names what changed.
(The slow tests resume real trainings; these pin each rule the fast suite let a mutant break.)"""

from __future__ import annotations

import json
import os
import time

import pytest

from bigmem_train.config import config_from_dict
from bigmem_train.errors import BadInput
from bigmem_train.verdict.rundir import FINISHED, prepare_run_dir, read_state, set_state


def job(results, name="r", **training):
    return config_from_dict(
        {
            "data": {"input_shape": [32, 32, 16]},
            "model": {"depth": 2},
            "training": {"batch_size": 4, **training},
            "output": {"results_dir": str(results), "run_name": name},
        }
    )


def test_a_new_named_run_gets_its_folder_its_config_and_a_running_state(tmp_path):
    run_dir, resuming = prepare_run_dir(job(tmp_path / "deep" / "results"))
    assert run_dir == tmp_path / "deep" / "results" / "r" and not resuming
    assert (run_dir / "config.yaml").read_text() == job(tmp_path / "deep" / "results").to_yaml()
    state = read_state(run_dir)
    assert state["state"] == "running" and state["pid"] == os.getpid()


def test_a_finished_run_is_refused_and_kept_as_it_is(tmp_path):
    run_dir, _ = prepare_run_dir(job(tmp_path))
    set_state(run_dir, FINISHED)
    before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    with pytest.raises(BadInput, match=r"already finished; choose another --run-name") as refused:
        prepare_run_dir(job(tmp_path))
    assert str(run_dir) in str(refused.value)
    assert {path.name: path.read_bytes() for path in run_dir.iterdir()} == before


def test_a_folder_that_is_not_a_run_is_refused_and_left_alone(tmp_path):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match=r"exists and is not a bigmem-train run") as refused:
        prepare_run_dir(job(tmp_path))
    assert str(folder) in str(refused.value)
    assert sorted(path.name for path in folder.iterdir()) == ["notes.txt"]
    # An empty folder of that name is taken as the run's.
    (tmp_path / "empty").mkdir()
    run_dir, resuming = prepare_run_dir(job(tmp_path, name="empty"))
    assert run_dir == tmp_path / "empty" and not resuming and (run_dir / "config.yaml").exists()


def test_unnamed_runs_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda pattern: "run-20261207-120000")
    config = job(tmp_path, name=None)
    folders = [prepare_run_dir(config)[0] for _ in range(3)]
    assert [folder.name for folder in folders] == [
        "run-20261207-120000",
        "run-20261207-120000-2",
        "run-20261207-120000-3",
    ]


def test_unnamed_runs_are_named_by_their_start_time(tmp_path):
    before = time.strftime("run-%Y%m%d-%H%M%S")
    run_dir, _ = prepare_run_dir(job(tmp_path, name=None))
    after = time.strftime("run-%Y%m%d-%H%M%S")
    # A fresh results folder: no suffix; the name is the run's start, to the second.
    assert before <= run_dir.name <= after


def test_a_resumed_run_drops_what_its_last_session_ended_with_and_keeps_the_rest(tmp_path, capsys):
    run_dir, _ = prepare_run_dir(job(tmp_path))
    (run_dir / "backup").mkdir()
    ended = {"stopped": "memory", "error": "x", "guard": {"a": 1}, "leaving": True, "slurm": {"job_id": "7"}}
    set_state(run_dir, "stopped", message="stopped", kept="yes", **ended)
    again, resuming = prepare_run_dir(job(tmp_path, batch_size=2))
    assert again == run_dir and resuming
    state = json.loads((run_dir / "state.json").read_text())
    assert not set(ended) & set(state), state
    assert state["kept"] == "yes" and state["state"] == "running"
    assert "bigmem-train: resuming r with a new training.batch_size\n" in capsys.readouterr().out


def test_a_changed_config_is_refused_with_what_a_resumed_run_may_change(tmp_path):
    prepare_run_dir(job(tmp_path))
    with pytest.raises(
        BadInput, match=r"\(a resumed run may change only training.worker_heartbeat_timeout\)"
    ):
        prepare_run_dir(job(tmp_path, batch_size=2))
