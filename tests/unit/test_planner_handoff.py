"""The job is planned once: a CLI re-executed under numactl/LD_PRELOAD takes the plan it is handed, typed."""

from bigmem_train.config import load_config
from bigmem_train.memory.placement import Placement
from bigmem_train.memory.plan import JobPlan
from bigmem_train.train import launch


def a_plan(config, peak=123) -> JobPlan:
    placement = Placement(
        "interleave", [0, 1], [0, 1, 2, 3], "larger than any one node", all_memory_nodes=True
    )
    return JobPlan(
        config,
        peak,
        {"weights": 100, "activations": peak - 100},
        2 * 2**30,
        placement,
        4,
        (240, 240, 144),
        "test constants",
        None,
        1,
    )


def test_a_relaunched_process_takes_the_plan_made_for_its_config(monkeypatch):
    requested = load_config(None, {"footprint.target": "2GiB"})
    sized = load_config(None, {"data.input_shape": [64, 64, 48]})
    plan = a_plan(sized)
    monkeypatch.setenv(launch.LAUNCHED_ENV, "1")
    monkeypatch.setenv(launch.PLAN_ENV, launch.handed_down_plan(requested, plan))
    inherited = launch.inherited_plan(requested)
    assert isinstance(inherited, JobPlan)
    assert inherited == plan  # every field, the placement and the sized config included
    assert inherited.placement.numactl_args() == ["numactl", "--interleave=all"]
    # Read once: a process it starts in turn plans for itself.
    assert launch.PLAN_ENV not in launch.os.environ


def test_a_plan_for_another_config_or_outside_a_relaunch_is_ignored(monkeypatch):
    requested = load_config(None, {"footprint.target": "2GiB"})
    handed = launch.handed_down_plan(requested, a_plan(requested, peak=1000))
    monkeypatch.setenv(launch.LAUNCHED_ENV, "1")
    monkeypatch.setenv(launch.PLAN_ENV, handed)
    assert launch.inherited_plan(load_config(None, {"footprint.target": "3GiB"})) is None
    monkeypatch.delenv(launch.LAUNCHED_ENV)
    monkeypatch.setenv(launch.PLAN_ENV, handed)
    assert launch.inherited_plan(requested) is None


def test_a_handed_down_value_that_is_not_a_plan_is_ignored_with_a_note(monkeypatch, capsys):
    requested = load_config(None, {"footprint.target": "2GiB"})
    monkeypatch.setenv(launch.LAUNCHED_ENV, "1")
    digest = launch._config_digest(requested)
    for value in [
        "not json",
        "[1, 2]",
        '"a string"',
        '{"config": {}}',
        f'{{"for": "{digest}", "config": {{"training": {{"batch_size": -1}}}}, "plan": {{}}}}',
        f'{{"for": "{digest}", "config": {{}}, "plan": {{"peak_bytes": 1}}}}',
        launch.handed_down_plan(requested, a_plan(requested))[:-1],
    ]:
        monkeypatch.setenv(launch.PLAN_ENV, value)
        assert launch.inherited_plan(requested) is None, value
        assert "not for this job; planning it again" in capsys.readouterr().out, value
