"""Where predict keeps OpenVINO's converted model and the int8 model (``engine.cached_or_made``): the first
copy that exists, else made in the first folder that can be made and written, else one line naming it."""

from __future__ import annotations

import pytest

from bigmem_train.errors import BadInput
from bigmem_train.infer.engine import cached_or_made


def _maker(made, answers=None):
    def make(target):
        made.append(target)
        if answers is not None and not answers.pop(0):
            return False
        target.write_text("model")
        return True

    return make


def test_the_copy_made_once_is_used_after_and_nothing_is_made_again(tmp_path):
    first, second = tmp_path / "a" / "model.xml", tmp_path / "b" / "model.xml"
    made = []
    assert cached_or_made([first, second], _maker(made), "x") == first and made == [first]
    made.clear()
    assert cached_or_made([first, second], _maker(made), "x") == first and made == []
    # Where the first folder cannot be made, a copy in the second is used as it is.
    second.parent.mkdir()
    second.write_text("cached")
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert cached_or_made([blocked / "a" / "model.xml", second], _maker(made), "x") == second and made == []


def test_a_folder_that_cannot_be_made_passes_to_the_next(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a plain file where a folder should be")
    made = []
    target = cached_or_made([blocked / "d" / "model.xml", tmp_path / "ok" / "model.xml"], _maker(made), "x")
    assert target == tmp_path / "ok" / "model.xml" and made == [target] and target.read_text() == "model"


def test_a_maker_that_meets_a_read_only_mount_passes_to_the_next(tmp_path):
    made = []
    targets = [tmp_path / "ro" / "model.xml", tmp_path / "tmp" / "model.xml"]
    assert cached_or_made(targets, _maker(made, [False, True]), "x") == targets[1] and made == targets


def test_no_writable_folder_is_the_callers_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(BadInput, match=r"^m\.keras: no writable folder for the int8 model$"):
        cached_or_made(
            [blocked / "a" / "x.xml"], _maker([]), "m.keras: no writable folder for the int8 model"
        )
    made = []
    with pytest.raises(BadInput, match="^neither$"):
        cached_or_made(
            [tmp_path / "a" / "x.xml", tmp_path / "b" / "x.xml"], _maker(made, [False, False]), "neither"
        )
    assert len(made) == 2
