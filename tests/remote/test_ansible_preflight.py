"""The preflight role sizes a multi-worker job per host: each host of bigmem_train_group holds its share
of the global batch, so a job whose global batch would not fit one host passes when its share does, and
the same batch as a single-node job is refused. Two inventory hosts that are both this machine
(ansible_connection=local); the role asks the kit's planner on the controller, with each host's
TF_CONFIG rendered from templates/tf_config.json.j2. Nothing is trained."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from bigmem_train.config import config_from_dict
from bigmem_train.host import read_host_facts
from bigmem_train.memory.estimate import estimate
from bigmem_train.ops.render import host_variables, render

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
MARGIN = 0.10

PLAYBOOK = """\
- name: Check the hosts against the job
  hosts: workers
  gather_facts: true
  roles:
    - role: bigmem_preflight
"""


def planned_peak(job: dict) -> int:
    """The planner's peak for the job as templates/train.yaml.j2 renders it, as one process."""
    text = render("train.yaml.j2", {**host_variables(read_host_facts()), **job})
    return sum(estimate(config_from_dict(yaml.safe_load(text), source="rendered train.yaml.j2")).values())


def job_that_fits_only_when_split() -> tuple[dict, int, int]:
    """A job (the study's net at a 160x160x128 tile) and an even global batch whose plan does not fit this
    host with the margin, while half of it, as a worker of a two-worker job, fits with room to spare
    (whatever this machine's memory)."""
    usable = read_host_facts().memory_total_bytes * (1 - MARGIN)
    base = {
        "input_shape": [160, 160, 128],
        "synthetic_shape": [176, 176, 136],
        "base_filters": 16,
        "depth": 4,
        "epochs": 1,
    }
    for batch in range(2, 129, 2):
        whole = planned_peak({**base, "batch_size": batch})
        if whole > usable:
            # As each worker of a multi-worker job is planned: half the batch, and Keras' batch normalization
            # (statistics synchronized across workers) in place of the fused layer.
            half = planned_peak({**base, "batch_size": batch // 2, "strategy": "multi_worker"})
            assert half < 0.95 * usable, (
                f"batch {batch}: half the job ({half} B) does not fit {usable} B either"
            )
            return {**base, "batch_size": batch}, whole, half
    raise AssertionError(f"no batch up to 128 passes {usable} B")


def run_play(folder: Path, job: dict, extra_vars: dict | None = None) -> subprocess.CompletedProcess:
    lines = [
        "[workers]",
        "w0 bigmem_train_worker_port=23456",
        "w1 bigmem_train_worker_port=23457",
        "",
        "[workers:vars]",
        "ansible_connection=local",
        f"ansible_python_interpreter={sys.executable}",
        "ansible_become=false",
        "bigmem_train_worker_address=127.0.0.1",
    ]
    (folder / "inventory.ini").write_text("\n".join(lines) + "\n")
    (folder / "preflight.yml").write_text(PLAYBOOK)
    extra = {
        "bigmem_train_group": "workers",
        "bigmem_train_job": job,
        "bigmem_train_templates_dir": str(REPO / "templates"),
        "bigmem_train_safety_margin": MARGIN,
        "bigmem_hugepages_count": 0,
        "bigmem_preflight_check_os": False,
        "bigmem_os_tuning_enabled": False,
        "bigmem_docker_engine_enabled": False,
        "bigmem_image_enabled": False,
        **(extra_vars or {}),
    }
    (folder / "extra.json").write_text(json.dumps(extra))
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible" / "ansible.cfg"),
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_ROLES_PATH=str(REPO / "ansible" / "roles"),
    )
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "-i",
            str(folder / "inventory.ini"),
            str(folder / "preflight.yml"),
            "-e",
            f"@{folder / 'extra.json'}",
        ],
        cwd=REPO / "ansible",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_preflight_plans_a_multi_worker_job_per_host(tmp_path: Path):
    job, _, _ = job_that_fits_only_when_split()

    split = run_play(tmp_path, {**job, "strategy": "multi_worker"})
    assert split.returncode == 0, split.stdout[-3000:] + split.stderr[-2000:]
    text = " ".join(split.stdout.split())  # the YAML callback folds long messages
    # Each host's check names its share: the peak of half the batch, two workers.
    assert text.count(f"per host: 2 workers, batch {job['batch_size'] // 2} each") == 2, split.stdout[-3000:]
    checked = [float(value) for value in re.findall(r": job ([0-9.]+) GiB \(the planned peak", text)]
    assert len(checked) == 2 and checked[0] == checked[1], checked

    single = run_play(tmp_path, job)
    assert single.returncode != 0
    text = " ".join(single.stdout.split())
    assert "the planned peak of bigmem_train_job" in text and "safety margin" in text, single.stdout[-3000:]
    assert "per host" not in text
    # The share is checked against what the same role said of the whole job on one host, not against the
    # planner called by this test: half the batch holds half the activations and all of the weights and the
    # runtime, so a little over half the whole (a role that planned the whole batch per host, or a quarter of
    # it, fails). How close the planner's figures are to what a worker really holds is measured by the
    # two-worker run's own verdict (test_multi_worker.py: the chief's plan criterion, measured peak within
    # footprint.tolerance of its plan).
    whole_said = [float(value) for value in re.findall(r"needs ([0-9.]+) GiB \(the planned peak", text)]
    assert whole_said, single.stdout[-3000:]
    assert 0.5 * whole_said[0] < checked[0] < 0.65 * whole_said[0], (checked, whole_said)


def test_a_value_no_role_accepts_stops_the_play_before_any_check(tmp_path: Path):
    """A mistyped knob is refused from its role's meta/argument_specs.yml before any of preflight's checks
    run: a later role's knob (THP mode) by preflight's first task, a shared knob (hugepage count, safety
    margin) by the shared bigmem role's own validation, which runs first; a valid value passes both."""
    for name, value, fragment in (
        ("bigmem_os_tuning_thp_enabled", "sometimes", "bigmem_os_tuning_thp_enabled must be one of"),
        ("bigmem_hugepages_count", "many", "argument 'bigmem_hugepages_count' is of type"),
        ("bigmem_train_safety_margin", "a tenth", "argument 'bigmem_train_safety_margin' is of type"),
    ):
        result = run_play(tmp_path, {"epochs": 1}, {name: value})
        text = " ".join(result.stdout.split())
        assert result.returncode == 2, result.stdout[-3000:]
        assert "Validation of arguments failed" in text and fragment in text, result.stdout[-3000:]
        assert "Ensure the feature flags are booleans" not in text, "a later task ran"
        if name == "bigmem_os_tuning_thp_enabled":
            assert "Ensure the values set for the kit's variables" in text
    fine = run_play(tmp_path, {"epochs": 1}, {"bigmem_os_tuning_thp_enabled": "madvise"})
    assert "Validation of arguments failed" not in fine.stdout, fine.stdout[-3000:]
    assert "Ensure the feature flags are booleans" in " ".join(fine.stdout.split())


def test_a_job_variable_no_template_reads_stops_the_play_before_any_check(tmp_path: Path):
    """`bigmem_train_job: {batchsize: 16}` would render the default batch without a word: the preflight
    names it, and the closest variable, before its other checks."""
    result = run_play(tmp_path, {"batchsize": 16, "epochs": 1})
    text = " ".join(result.stdout.split())
    assert result.returncode == 2, result.stdout[-3000:]
    assert (
        "bigmem_train_job: 'batchsize' (did you mean 'batch_size'?) is not read by train.yaml.j2" in text
    ), result.stdout[-3000:]
    assert "Ensure the feature flags are booleans" not in text, "a later task ran"
