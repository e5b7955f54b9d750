"""The winning performance settings (docs/design/performance.md) stay wired as the defaults; not the speed."""

import sys
from pathlib import Path

import pytest

from bigmem_train.config import Config, load_config
from bigmem_train.host import HostFacts
from bigmem_train.ops.render import render
from bigmem_train.train.launch import ALLOCATOR_LIBRARIES, choose_threads, launch_command

REPO = Path(__file__).resolve().parents[2]


def one_node_host(cores: int = 2) -> HostFacts:
    return HostFacts(
        hostname="h",
        memory_total_bytes=2**34,
        memory_available_bytes=2**34,
        swap_total_bytes=0,
        cgroup_limit_bytes=None,
        cgroup_version=2,
        logical_cpus=cores,
        physical_cores=cores,
        usable_cpus=list(range(cores)),
    )


def test_runtime_defaults_are_the_measured_winners():
    runtime = Config().runtime
    assert runtime.onednn is True  # stock TF leaves oneDNN off on AVX2-only CPUs: 3-4x slower
    assert runtime.allocator == "tcmalloc"  # fastest and lowest peak of glibc/jemalloc/tcmalloc here
    assert runtime.precision == "float32"  # no AVX512_BF16/AMX here: mixed_bfloat16 is slower
    assert Config().model.recompute is False  # a memory lever, not a speed lever: opt-in
    assert runtime.tensor_allocator == "system"  # TensorFlow's BFC pool fragments at the study's scale
    assert runtime.inline_ops is True  # the same job peaks the same in every run, at the same speed
    for preset in ("default", "study"):
        assert load_config(preset).runtime == runtime


def test_threads_default_to_all_cores_and_ops_one_at_a_time_in_the_calling_thread():
    # -1: TensorFlow runs every op inline (a pool thread would run a second op beside the calling thread,
    # in an order that varies from run to run, and the peak with it).
    assert choose_threads(Config(), one_node_host(2)) == (2, -1)
    assert choose_threads(Config(), one_node_host(48)) == (48, -1)
    # A rendered config names one inter-op thread; inline still wins for a single-host job ...
    assert choose_threads(load_config(None, {"runtime.inter_op_threads": 1}), one_node_host(2)) == (2, -1)
    # ... not for a multi-worker one (its collective ops need the pool), nor when switched off.
    multi = load_config(None, {"training.strategy": "multi_worker"})
    assert choose_threads(multi, one_node_host(2)) == (2, 1)
    pool = {"runtime.inline_ops": False, "runtime.inter_op_threads": 2}
    assert choose_threads(load_config(None, pool), one_node_host(2)) == (2, 2)
    assert choose_threads(load_config(None, {"runtime.inline_ops": False}), one_node_host(2)) == (2, 1)


def test_the_launcher_preloads_the_default_allocator(monkeypatch):
    monkeypatch.delenv("BIGMEM_TRAIN_LAUNCHED", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    installed = [path for path in ALLOCATOR_LIBRARIES["tcmalloc"] if Path(path).exists()]
    if not installed:
        pytest.skip("tcmalloc is not installed here (scripts/apt-packages.txt: libtcmalloc-minimal4)")
    command, environment = launch_command(Config(), [])
    assert environment["LD_PRELOAD"].split(":")[0] == installed[0]
    assert environment["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] == "1"
    assert command[:3] == [sys.executable, "-m", "bigmem_train.cli"]


def test_rendered_runtime_keeps_onednn_on():
    text = render(
        "runtime.env.j2",
        {
            "hostname": "h",
            "physical_cores": 2,
            "numa_node_count": 1,
            "memory_total_bytes": 2**34,
            "logical_cpus": 2,
        },
    )
    assert "TF_ENABLE_ONEDNN_OPTS=1" in text.splitlines()


def test_the_benchmark_measures_the_defaults():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import throughput
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    runtime = Config().runtime
    assert throughput.CHOSEN["allocator"] == runtime.allocator
    assert throughput.CHOSEN["precision"] == runtime.precision
    assert throughput.CHOSEN["recompute"] == Config().model.recompute
    assert throughput.CHOSEN["onednn"] == runtime.onednn
    assert (throughput.CHOSEN["intra"], throughput.CHOSEN["inter"]) == (None, None)  # launch.choose_threads


def test_the_tensor_allocator_reaches_tensorflow_through_the_environment():
    from bigmem_train.train.launch import runtime_environment

    assert runtime_environment(Config(), {})["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] == "1"
    pooled = load_config(None, {"runtime.tensor_allocator": "bfc"})
    assert (
        runtime_environment(pooled, {"TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1"})["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"]
        == "0"
    )
