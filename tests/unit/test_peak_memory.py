"""The process peak that training and predict report (metrics.json's ``peak_rss_bytes``, predict.json's
per-case peak) is the process's own. getrusage's ``ru_maxrss`` is not: the kernel carries the starting
process's high-water mark into the child through fork and exec, so a run started by a test runner or a
notebook that had grown to a gigabyte "peaked" at a gigabyte (CI: both memory-guard reruns, started by a
pytest that had run the unit tests, judged 31 % above their plan with the same 1,221,689,344 B)."""

import subprocess
import sys

from bigmem_train.train.monitor import peak_rss_bytes, rss_bytes

MIB = 1024**2
CHILD = (
    "from bigmem_train.infer import predict; from bigmem_train.train import loop, monitor; "
    "assert predict.peak_rss_bytes is monitor.peak_rss_bytes is loop.peak_rss_bytes; "
    "print(monitor.peak_rss_bytes())"
)


def test_a_child_of_a_large_process_reports_its_own_peak():
    ballast = bytearray(400 * MIB)
    ballast[::4096] = b"\x01" * len(range(0, len(ballast), 4096))  # resident, page by page
    assert rss_bytes() > 400 * MIB
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    child_peak = int(done.stdout.split()[-1])
    # The child imports bigmem-train's modules (TensorFlow is not among them): tens of MiB, not the
    # parent's 400 MiB ballast.
    assert 0 < child_peak < 300 * MIB, child_peak
    del ballast


def test_the_peak_is_at_least_what_is_resident_now_and_holds_after_a_release():
    before = peak_rss_bytes()
    assert before >= rss_bytes() > 0
    grown = bytearray(200 * MIB)
    grown[::4096] = b"\x01" * len(range(0, len(grown), 4096))
    during = peak_rss_bytes()
    assert during >= rss_bytes() and during >= 200 * MIB
    del grown
    assert peak_rss_bytes() >= during
