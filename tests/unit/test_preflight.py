"""Preflight: refuse a plan that cannot fit, with one actionable message; the CLI's exit code 3."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bigmem_train import cli
from bigmem_train.cli import commands
from bigmem_train.config import load_config
from bigmem_train.errors import DoesNotFit
from bigmem_train.host import read_host_facts
from bigmem_train.memory import preflight
from bigmem_train.memory.plan import allowance as plan_allowance
from bigmem_train.memory.plan import plan_job
from tests.fixtures.common import TEST_CALIBRATION as CALIBRATION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GIB = 1024**3


@pytest.fixture(autouse=True)
def tables(recorded_tables):
    """Recorded layer tables instead of building the model."""


def host(name: str):
    return read_host_facts(FIXTURES / "hosts" / name)


def test_study_job_is_refused_in_a_small_container_with_an_actionable_message():
    small = host("one_node_cgroup2")
    plan = plan_job(load_config("study"), small, CALIBRATION)
    with pytest.raises(DoesNotFit) as refused:
        preflight.check_fits(plan, small)
    message = str(refused.value)
    assert "predicted peak" in message and "GiB" in message
    assert (
        "usable (the cgroup v2 memory limit 8589934592 B (8.00 GiB), less what keeps a run 3% above its plan "
        "under the memory guard's 97% of it)" in message
    )
    assert "not even batch 1 fits at 240x240x144" in message
    assert "largest input shape that fits at batch 1" in message
    # The levers, cheapest first, each with its predicted peak and step-time factor; here none keeps the
    # batch and the tile (recomputation alone does not bring the study's job under 8 GiB).
    levers = message.split("what would make it fit, cheapest first: ")[1]
    assert levers.startswith("(1) data.input_shape: [") and "x the step time" in levers
    assert "model.recompute" not in levers
    assert refused.value.exit_code == 3


def test_a_refusal_lists_recomputation_first_when_it_makes_the_job_fit():
    small = host("two_node_cgroup1")
    # The smallest batch of the study's tile that this host refuses as configured.
    for batch in range(1, 64):
        config = load_config("study", {"training.batch_size": batch, "footprint.levers": "off"})
        plan = plan_job(config, small, CALIBRATION)
        if plan.peak_bytes > preflight.usable_bytes(plan, small):
            break
    with pytest.raises(DoesNotFit) as refused:
        preflight.check_fits(plan, small)
    levers = str(refused.value).split("what would make it fit, cheapest first: ")[1]
    assert levers.startswith("(1) model.recompute: true: predicted peak ")
    assert "1.47x the step time" in levers and f"training.batch_size: {batch - 1}" in levers
    # The recorded hosts have AMX: bfloat16 is offered, with the step-time factor measured on such a CPU.
    assert "runtime.precision: mixed_bfloat16: predicted peak" in levers and "0.57x the step time" in levers
    assert "step time not measured" not in levers
    # footprint.levers: auto (the study preset's) applies the first: same batch and tile, recomputation on.
    auto = plan_job(load_config("study", {"training.batch_size": batch}), small, CALIBRATION)
    assert auto.lever == "model.recompute: true" and auto.config.model.recompute
    assert auto.config.training.batch_size == batch and auto.config.data.input_shape == (240, 240, 144)
    preflight.check_fits(auto, small)


def test_a_job_that_fits_passes():
    big = host("four_node_cxl_cgroup2")
    plan = plan_job(load_config("study"), big, CALIBRATION)
    preflight.check_fits(plan, big)  # no exception


def test_largest_batch_suggested_really_fits():
    small = host("two_node_cgroup1")
    config = load_config(
        "study", {"data.input_shape": [160, 160, 128], "training.batch_size": 64, "footprint.levers": "off"}
    )
    plan = plan_job(config, small, CALIBRATION)
    with pytest.raises(DoesNotFit):
        preflight.check_fits(plan, small)
    usable = preflight.usable_bytes(plan, small)
    batch, shape = preflight.largest_fitting(plan, usable)
    assert batch >= 1
    fitting = plan_job(
        load_config(
            "study",
            {"data.input_shape": [160, 160, 128], "training.batch_size": batch, "footprint.levers": "off"},
        ),
        small,
        CALIBRATION,
    )
    preflight.check_fits(fitting, small)


def test_static_hugepages_are_not_available_to_the_job():
    pmem = host("two_node_pmem_cgroup1")
    config = load_config("study", {"data.input_shape": [240, 240, 144], "training.batch_size": 64})
    with pytest.raises(DoesNotFit) as refused:
        preflight.check_fits(plan_job(config, pmem, CALIBRATION), pmem)
    assert "static hugepages" in str(refused.value)


def test_bound_plan_is_checked_against_its_node():
    two = host("two_node_cgroup1")
    plan = plan_job(load_config("study", {"training.batch_size": 4}), two, CALIBRATION)
    assert plan.placement.policy == "bind"
    node = {n.node_id: n for n in two.numa_nodes}[plan.placement.nodes[0]]
    assert preflight.usable_bytes(plan, two) == int(
        min(node.memory_available_bytes, two.effective_memory_bytes) * 0.9
    )


def test_preflight_command_prints_host_facts_and_exits_3(monkeypatch, capsys):
    monkeypatch.setattr(commands, "read_host_facts", lambda: host("one_node_cgroup2"))
    code = cli.main(["preflight", "--config", "study"])
    captured = capsys.readouterr()
    assert code == 3
    for fact in (
        "memory total",
        "memory available",
        "cgroup limit",
        "swap",
        "transparent hugepages",
        "static hugepages",
        "NUMA nodes",
        "node 0",
    ):
        assert fact in captured.out
    assert "predicted peak" in captured.err


def test_preflight_command_json(monkeypatch, capsys):
    monkeypatch.setattr(commands, "read_host_facts", lambda: host("four_node_cxl_cgroup2"))
    code = cli.main(["preflight", "--config", "study", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["fits"] is True
    assert [node["cpus"] for node in data["host"]["numa_nodes"]] == [32, 32, 0, 0]
    assert data["host"]["cgroup_limit"]["gib"] == 1536.0
    assert data["plan"]["placement"]["policy"] in {"bind", "interleave"}


def test_the_allowance_under_a_cgroup_limit_keeps_the_plans_promise_under_the_guard():
    """Under a cgroup limit L (the job's own: Slurm's --mem, docker --memory) a job may plan up to
    L x guard.threshold / 1.03, so a run 3 % above its plan stays under the point where the guard stops it;
    the host's safety margin is for MemAvailable, which others share. Values computed here, not by the kit."""
    container = host("one_node_cgroup2")
    limit = container.cgroup_limit_bytes
    assert limit == 8 * GIB and container.memory_available_bytes * 0.9 > limit
    config = load_config("study", {"training.batch_size": 1, "data.input_shape": [64, 64, 64]})
    assert plan_allowance(config, container)[0] == int(8 * GIB * 0.97 / 1.03)
    stricter = load_config("study", {"training.batch_size": 1, "guard.threshold": 0.9})
    assert plan_allowance(stricter, container)[0] == int(8 * GIB * 0.9 / 1.03)
    # Where the host has less available than that, its available memory less the margin decides.
    crowded = dataclasses.replace(container, memory_available_bytes=6 * GIB)
    usable, why, by_cgroup = plan_allowance(config, crowded)
    assert not by_cgroup and plan_allowance(config, container).by_cgroup
    assert usable == int(6 * GIB * 0.9) and "MemAvailable" in why and "10% safety margin" in why
    no_cgroup = dataclasses.replace(container, cgroup_limit_bytes=None)
    assert plan_allowance(config, no_cgroup)[0] == int(container.memory_available_bytes * 0.9)


@pytest.mark.parametrize("threshold", [0.97, 0.9])
def test_a_job_given_the_mem_submit_asks_for_fits_it_and_one_mib_less_does_not(threshold):
    """``bigmem-train submit``'s --mem is the smallest cgroup limit the job's own preflight accepts: the job
    Slurm starts with it runs; a limit of one MiB less is refused (exit 3) before it trains."""
    from bigmem_train.ops.scheduler import mem_request_mib

    container = host("one_node_cgroup2")
    config = load_config("study", {"data.input_shape": [96, 96, 64], "guard.threshold": threshold})
    plan = plan_job(config, container, CALIBRATION, to_run_here=False)
    request = mem_request_mib(plan)
    assert request == math.ceil(plan.peak_bytes * 1.03 / threshold / 2**20)
    given = dataclasses.replace(container, cgroup_limit_bytes=request * 2**20)
    preflight.check_fits(plan, given)
    short = dataclasses.replace(container, cgroup_limit_bytes=(request - 1) * 2**20)
    with pytest.raises(DoesNotFit, match="the cgroup v2 memory limit"):
        preflight.check_fits(plan, short)
