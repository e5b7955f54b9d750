"""heap_limit.py: a run held to a cap hands freed pages back instead of growing past it, and fails an
allocation that really needs more; the setting's values and errors."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bigmem_train.config import Config
from bigmem_train.train.launch import allocator_library

MIB = 1 << 20

# Strands free spans the way a training step does (many blocks freed, none of them large enough for the next
# request), then asks for blocks of a larger size: unheld, tcmalloc maps more; held, it hands the free spans
# back first. Then asks for more than the cap allows in use.
CHILD = textwrap.dedent(
    """
    import ctypes, json, sys
    from bigmem_train.train import heap_limit

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    MIB = 1 << 20

    def fill(size, count):
        blocks = [libc.malloc(size) for _ in range(count)]
        for address in blocks:
            ctypes.memset(address, 1, size)
        return blocks

    cap = int(sys.argv[1]) * MIB
    held = heap_limit.hold(cap, "test") if cap else None
    small = fill(3 * MIB, 100)  # 300 MiB in 3 MiB spans
    keep = [small[i] for i in range(0, 100, 10)]  # every tenth stays in use: the free runs are 27 MiB
    for address in small:
        if address not in keep:
            libc.free(address)
    large = fill(40 * MIB, 6)  # 240 MiB in spans larger than any free run
    after_large = rss()
    too_much = libc.malloc(int(sys.argv[2]) * MIB)
    print(json.dumps({
        "held": held.to_dict() if held else None,
        "rss_after_large": after_large,
        "larger_than_cap_allocated": bool(too_much),
        "limit_now": heap_limit.current_limit_bytes(),
    }))
    """
)


def _run_child(tmp_path, cap_mib: int, preload: str | None, request_mib: int = 1) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run(
        [sys.executable, str(script), str(cap_mib), str(request_mib)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def tcmalloc() -> str:
    library = allocator_library("tcmalloc")
    if library is None:
        pytest.skip("tcmalloc is not installed")
    return library


def test_unheld_tcmalloc_grows_past_what_a_held_run_keeps(tmp_path, tcmalloc):
    unheld = _run_child(tmp_path, 0, tcmalloc)
    held = _run_child(tmp_path, 400, tcmalloc)
    assert unheld["held"] is None
    # Unheld: the 270 MiB of stranded 3 MiB spans stay mapped beside the 240 MiB of large blocks.
    assert unheld["rss_after_large"] > 480 * MIB, unheld
    # Held at 400 MiB: the free spans went back before the heap grew; the process stayed at its cap.
    info = held["held"]
    assert info is not None and info["cap_bytes"] == 400 * MIB
    assert info["limit_bytes"] == (400 * MIB - info["outside_heap_bytes"]) // MIB * MIB
    assert held["rss_after_large"] <= 400 * MIB + 16 * MIB, held
    assert held["limit_now"] == info["limit_bytes"]


def test_an_allocation_past_the_cap_fails_instead_of_growing(tmp_path, tcmalloc):
    assert _run_child(tmp_path, 0, tcmalloc, request_mib=800)["larger_than_cap_allocated"] is True
    assert _run_child(tmp_path, 400, tcmalloc, request_mib=800)["larger_than_cap_allocated"] is False


def test_without_tcmalloc_nothing_is_held(tmp_path):
    result = _run_child(tmp_path, 400, None)
    assert result["held"] is None and result["limit_now"] is None


def test_a_cap_below_what_the_process_holds_is_not_set(tmp_path, tcmalloc):
    result = _run_child(tmp_path, 1, tcmalloc)
    assert result["held"] is None and result["limit_now"] == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [("plan", "plan"), ("off", "off"), (False, "off"), ("64GiB", "64GiB"), ("80%", "80%")],
)
def test_heap_limit_setting(value, expected):
    assert Config.model_validate({"runtime": {"heap_limit": value}}).runtime.heap_limit == expected


@pytest.mark.parametrize("value", ["lots", "0GiB", 12])
def test_bad_heap_limit_is_named(value):
    with pytest.raises(Exception) as error:
        Config.model_validate({"runtime": {"heap_limit": value}})
    assert "heap_limit" in str(error.value)


def test_a_run_stopped_at_its_heap_limit_is_a_memory_stop_with_both_figures():
    from bigmem_train.errors import EXIT_DOES_NOT_FIT
    from bigmem_train.train.heap_limit import HeapLimit
    from bigmem_train.train.loop import heap_limit_stop

    held = HeapLimit(
        cap_bytes=4 * 1024 * MIB, outside_heap_bytes=460 * MIB, limit_bytes=3636 * MIB, source="4GiB"
    )
    stop = heap_limit_stop(
        held, RuntimeError("OOM when allocating tensor with shape[2,16,64,64,48]\nmore"), None, "r1"
    )
    assert stop.exit_code == EXIT_DOES_NOT_FIT
    assert stop.record["stopped"] == "memory" and stop.record["reason"] == "heap_limit"
    assert stop.record["heap_limit"]["limit_bytes"] == 3636 * MIB
    assert stop.record["error"] == "OOM when allocating tensor with shape[2,16,64,64,48]"
    message = str(stop)
    assert "run r1 stopped" in message and "4.00 GiB" in message and "3.55 GiB" in message


def test_runs_are_not_held_unless_asked():
    assert Config().runtime.heap_limit == "off"
