"""Test runs only: scripts/test.sh puts this folder on PYTHONPATH, so that every Python process of the suite
(Ansible's modules on this machine included) keeps the bytecode of what it imports from zip archives in
$BIGMEM_ZIPIMPORT_CACHE: the lab VM's hook (tests/lab/guest/zipimport_cache.py), here for the plays the suite
runs on this machine (the BIOS role's against the Redfish emulator: about 45 plays). Without the variable it
does nothing."""

import importlib.util
import os

_directory = os.environ.get("BIGMEM_ZIPIMPORT_CACHE")
if _directory:
    _path = os.path.join(os.path.dirname(__file__), os.pardir, "lab", "guest", "zipimport_cache.py")
    _spec = importlib.util.spec_from_file_location("_bigmem_zipimport_cache", _path)
    if _spec is not None and os.path.exists(_path):
        _module = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_module)
        _module.install(_directory)
