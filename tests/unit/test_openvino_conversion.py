"""How predict reads the outcome of OpenVINO's one-time conversion (infer/engine.py:converted_model).

The conversion runs in a child process (`python -m bigmem_train.infer.engine --convert MODEL TARGET`,
which imports TensorFlow). Here that child is a stand-in, named as such: a replacement of
``subprocess.run`` that answers as the real child does in each case (its exit code, its stdout's
``peak_rss_bytes`` line, its stderr's last line) and, where it succeeds, writes the target file. The real
child runs in tests/unit/test_predict.py's OpenVINO tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bigmem_train.errors import BadInput
from bigmem_train.infer import engine


class StandInChild:
    """subprocess.run for the conversion child: each call takes the next of ``answers``
    (returncode, stdout, stderr, writes the target)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.targets: list[Path] = []

    def __call__(self, command, **kwargs):
        assert command[1:4] == ["-m", "bigmem_train.infer.engine", "--convert"], command
        assert kwargs["env"]["TF_CPP_MIN_LOG_LEVEL"] == "3"  # TensorFlow's start-up lines kept out of stderr
        returncode, stdout, stderr, writes = self.answers.pop(0)
        target = Path(command[5])
        self.targets.append(target)
        if writes:
            target.write_text("<net/>\n")
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)


@pytest.fixture
def model(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("BIGMEM_CACHE_DIR", str(cache))
    monkeypatch.setattr(engine.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    path = tmp_path / "best.keras"
    path.write_bytes(b"a model")
    return path


def test_a_conversion_reports_its_peak_and_time_and_is_cached(model, monkeypatch):
    child = StandInChild((0, "converted\npeak_rss_bytes 123\npeak_rss_bytes 750000000\n", "", True))
    monkeypatch.setattr(engine.subprocess, "run", child)
    records = []
    path = engine.converted_model(model, records.append)
    assert path == child.targets[0] and path.is_file()
    assert path.parent.name == engine.file_digest(model) and "cache" in path.parts
    assert len(records) == 1 and records[0]["peak_rss_bytes"] == 750000000  # the last such line
    assert isinstance(records[0]["seconds"], float)
    # Cached: no second child, no second record.
    assert engine.converted_model(model, records.append) == path and len(records) == 1


def test_a_child_without_a_peak_line_reports_none(model, monkeypatch):
    monkeypatch.setattr(engine.subprocess, "run", StandInChild((0, "", "", True)))
    records = []
    engine.converted_model(model, records.append)
    assert records[0]["peak_rss_bytes"] is None


def test_the_childs_bad_input_is_passed_on_as_its_one_line(model, monkeypatch):
    stderr = (
        "Traceback ...\n  noise\nBadInput: best.keras: cannot be loaded as a Keras model (ValueError: x)\n\n"
    )
    monkeypatch.setattr(engine.subprocess, "run", StandInChild((2, "", stderr, False)))
    with pytest.raises(BadInput) as refused:
        engine.converted_model(model)
    assert str(refused.value) == "best.keras: cannot be loaded as a Keras model (ValueError: x)"


def test_another_failure_of_the_child_is_named_with_its_last_line(model, monkeypatch):
    stderr = "Traceback ...\nRuntimeError: Check 'shape' failed\n"
    monkeypatch.setattr(engine.subprocess, "run", StandInChild((1, "", stderr, False)))
    with pytest.raises(
        BadInput, match=r"OpenVINO could not convert it \(RuntimeError: Check 'shape' failed\)"
    ):
        engine.converted_model(model)
    monkeypatch.setattr(engine.subprocess, "run", StandInChild((1, "", "", False)))
    with pytest.raises(BadInput, match=r"could not convert it \(no output\)"):
        engine.converted_model(model)
    # Exit 0 without the file it was to write is no success either.
    monkeypatch.setattr(engine.subprocess, "run", StandInChild((0, "", "", False), (0, "", "", False)))
    with pytest.raises(BadInput, match="no writable folder for OpenVINO's converted model"):
        engine.converted_model(model)


def test_a_read_only_cache_falls_back_to_the_temporary_folder(model, monkeypatch, tmp_path):
    # The first target's folder is writable for this process but the child meets a read-only mount.
    child = StandInChild(
        (1, "", "OSError: [Errno 30] Read-only file system: 'model.xml'\n", False),
        (0, "peak_rss_bytes 5\n", "", True),
    )
    monkeypatch.setattr(engine.subprocess, "run", child)
    path = engine.converted_model(model)
    assert len(child.targets) == 2 and path == child.targets[1]
    assert path.is_relative_to(tmp_path / "tmp" / "bigmem-train-openvino")
