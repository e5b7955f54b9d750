"""release.py: the allocator's free pages go back to the kernel when asked, for each allocator installed."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bigmem_train.train.launch import allocator_library

CHILD = textwrap.dedent(
    """
    import ctypes, json, sys
    from bigmem_train.train.release import release_function

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 96 * 1024, 3000  # ~280 MiB in blocks every allocator keeps in its heap
    blocks = [libc.malloc(block) for _ in range(count)]
    for address in blocks:
        ctypes.memset(address, 1, block)
    keep = libc.malloc(block)  # above the freed ones: nothing is trimmed from the top by itself
    ctypes.memset(keep, 1, block)
    before = rss()
    for address in blocks:
        libc.free(address)
    freed = rss()
    release = release_function(sys.argv[1])
    release()
    print(json.dumps({"before": before, "freed": freed, "released": rss(), "total": block * count}))
    """
)


@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc", "jemalloc"])
def test_free_pages_go_back_to_the_kernel(allocator, tmp_path):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if allocator != "glibc":
        library = allocator_library(allocator)
        if library is None:
            pytest.skip(f"{allocator} is not installed")
        env["LD_PRELOAD"] = library
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run(
        [sys.executable, str(script), allocator], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    # Freed, then handed back: the resident set ends within a fifth of the blocks of where it was without them,
    # and the call itself gave back pages the allocator had kept (jemalloc purges part of them by itself).
    assert figures["released"] < figures["before"] - 0.8 * figures["total"], figures
    assert figures["freed"] - figures["released"] > 16 * 2**20, figures


def test_no_release_for_an_allocator_that_is_not_mapped():
    from bigmem_train.train.release import release_function

    # This process runs on glibc (no LD_PRELOAD in the test run): tcmalloc's entry point is not there.
    if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("tcmalloc preloaded into the test process")
    assert release_function("tcmalloc") is None
    assert release_function("glibc") is not None
