"""The job is planned once: a CLI re-executed under numactl/LD_PRELOAD takes the plan it is handed."""

from bigmem_train import pipeline
from bigmem_train.config import load_config


def test_a_relaunched_process_takes_the_plan_made_for_its_config(monkeypatch):
    requested = load_config(None, {"footprint.target": "2GiB"})
    sized = load_config(None, {"data.input_shape": [64, 64, 48]})
    plan = {"peak_bytes": 123, "input_shape": [64, 64, 48]}
    monkeypatch.setenv(pipeline.LAUNCHED_ENV, "1")
    monkeypatch.setenv(pipeline.PLAN_ENV, pipeline.handed_down_plan(requested, sized, plan))
    config, plan_dict = pipeline.inherited_plan(requested)
    assert config == sized
    assert plan_dict == plan
    # Read once: a process it starts in turn plans for itself.
    assert pipeline.PLAN_ENV not in pipeline.os.environ


def test_a_plan_for_another_config_or_outside_a_relaunch_is_ignored(monkeypatch):
    requested = load_config(None, {"footprint.target": "2GiB"})
    handed = pipeline.handed_down_plan(requested, requested, {"peak_bytes": 1})
    monkeypatch.setenv(pipeline.LAUNCHED_ENV, "1")
    monkeypatch.setenv(pipeline.PLAN_ENV, handed)
    assert pipeline.inherited_plan(load_config(None, {"footprint.target": "3GiB"})) is None
    monkeypatch.delenv(pipeline.LAUNCHED_ENV)
    monkeypatch.setenv(pipeline.PLAN_ENV, handed)
    assert pipeline.inherited_plan(requested) is None


def test_a_handed_down_value_that_is_not_a_plan_is_ignored_with_a_note(monkeypatch, capsys):
    requested = load_config(None, {"footprint.target": "2GiB"})
    monkeypatch.setenv(pipeline.LAUNCHED_ENV, "1")
    digest = pipeline._config_digest(requested)
    for value in ["not json", "[1, 2]", '"a string"', '{"config": {}}',
                  '{"for": "%s", "config": {"training": {"batch_size": -1}}, "plan": {}}' % digest,
                  pipeline.handed_down_plan(requested, requested, {})[:-1]]:
        monkeypatch.setenv(pipeline.PLAN_ENV, value)
        assert pipeline.inherited_plan(requested) is None, value
        assert "not for this job; planning it again" in capsys.readouterr().out, value
