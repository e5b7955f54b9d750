"""Test runs only: scripts/test.sh puts this folder on PYTHONPATH, so that every Python process of the suite
(Ansible's modules on this machine included) keeps the bytecode of what it imports from zip archives in
$BIGMEM_ZIPIMPORT_CACHE: the lab VM's hook (tests/lab/guest/zipimport_cache.py), here for the plays the suite
runs on this machine (the BIOS role's against the Redfish emulator: about 40 plays). Without the variable it
does nothing. The sitecustomize this one shadows (Debian's python3 has one) still runs, after it."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_directory = os.environ.get("BIGMEM_ZIPIMPORT_CACHE")
if _directory:
    _path = os.path.join(_here, os.pardir, "lab", "guest", "zipimport_cache.py")
    _spec = importlib.util.spec_from_file_location("_bigmem_zipimport_cache", _path)
    if _spec is not None and os.path.exists(_path):
        _module = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_module)
        _module.install(_directory)

_rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _here]
_shadowed = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _shadowed is not None and _shadowed.loader is not None:
    _shadowed.loader.exec_module(importlib.util.module_from_spec(_shadowed))
