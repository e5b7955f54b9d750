"""Lab VM only: keep the code Python compiles for modules imported from zip archives.

Ansible runs every module on a host as an AnsiballZ payload, a zip that Python imports from without
writing bytecode, so each task compiles ansible.module_utils afresh: under QEMU's software emulation about
a quarter of a task's time (a play of 59 tasks on the lab VM: 147 s without, 110-117 s with it). The build
script installs this module with a .pth line that imports it at startup. It caches each compiled source
under /var/cache/lab-zipimport, keyed by the source's bytes and its path inside the archive, so the same
source compiles once per VM; the code is what compile() returned for the same bytes. Only processes that
may write the folder (root: Ansible's become) use it. A real server does not need it.
"""

import hashlib
import marshal
import os
import sys
import zipimport

DIRECTORY = "/var/cache/lab-zipimport"


def _cached(compile_source, directory):
    def compile_cached(pathname, source):
        inner = pathname.rsplit(".zip" + os.sep, 1)[-1]
        key = hashlib.sha256(inner.encode() + b"\0" + source).hexdigest()
        path = os.path.join(directory, f"{key}.{sys.implementation.cache_tag}")
        try:
            with open(path, "rb") as handle:
                return marshal.load(handle)
        except (OSError, EOFError, ValueError, TypeError):
            pass
        code = compile_source(pathname, source)
        temporary = f"{path}.{os.getpid()}"
        try:
            with open(temporary, "wb") as handle:
                marshal.dump(code, handle)
            os.replace(temporary, path)
        except OSError:
            pass
        return code

    return compile_cached


def install(directory=DIRECTORY):
    """Cache zipimport's compilations in ``directory`` when this process may write it; True if it does."""
    compile_source = getattr(zipimport, "_compile_source", None)
    if compile_source is None or not os.access(directory, os.W_OK | os.X_OK):
        return False
    zipimport._compile_source = _cached(compile_source, directory)
    return True


install()
