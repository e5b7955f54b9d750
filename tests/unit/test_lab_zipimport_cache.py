"""The lab VM's zipimport cache (tests/lab/guest/zipimport_cache.py): a module imported from a zip is
compiled once, later imports load the stored code, and a changed source is compiled again."""

from __future__ import annotations

import importlib.util
import zipfile
import zipimport
from pathlib import Path

from tests.fixtures.common import REPO_ROOT


def _load_hook():
    spec = importlib.util.spec_from_file_location(
        "lab_zipimport_cache_under_test", REPO_ROOT / "tests" / "lab" / "guest" / "zipimport_cache.py"
    )
    module = importlib.util.module_from_spec(spec)
    original = zipimport._compile_source
    spec.loader.exec_module(module)  # its own install() finds /var/cache/lab-zipimport absent here
    zipimport._compile_source = original
    return module


def _import_from(archive: Path, name: str):
    spec = zipimport.zipimporter(str(archive)).find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_zip_import_compiles_once_and_a_changed_source_again(tmp_path, monkeypatch):
    hook = _load_hook()
    cache = tmp_path / "cache"
    cache.mkdir()
    calls = []
    original = zipimport._compile_source

    def counting(pathname, source):
        calls.append(pathname)
        return original(pathname, source)

    monkeypatch.setattr(zipimport, "_compile_source", counting)
    assert hook.install(str(cache)) is True
    for run, value in ((1, 41), (2, 41), (3, 42)):
        archive = (
            tmp_path / f"payload-{run}.zip"
        )  # a fresh archive path each time, as AnsiballZ's temp folder
        with zipfile.ZipFile(archive, "w") as zipped:
            zipped.writestr("lab_cached_mod.py", f"VALUE = {value}\n")
        assert _import_from(archive, "lab_cached_mod").VALUE == value
    assert len(calls) == 2, calls  # the second import of the same source came from the cache
    assert len(list(cache.iterdir())) == 2


def test_it_stays_off_where_the_folder_is_not_writable(tmp_path, monkeypatch):
    hook = _load_hook()
    original = zipimport._compile_source
    monkeypatch.setattr(zipimport, "_compile_source", original)
    assert hook.install(str(tmp_path / "absent")) is False
    assert zipimport._compile_source is original
