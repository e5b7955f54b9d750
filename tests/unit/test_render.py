"""The shared templates: rendered by `bigmem-train render` and by Ansible to the same text, and a
rendered job config is a valid config."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bigmem_train
from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.host import HostFacts, NumaNode
from bigmem_train.ops.render import host_variables, list_templates, parse_variables, render, templates_dir
from bigmem_train.ops.template_names import JOB_TEMPLATES, check_variable_names, template_names

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def two_node_host() -> HostFacts:
    nodes = [
        NumaNode(
            node_id=i,
            memory_total_bytes=768 * 2**30,
            memory_free_bytes=700 * 2**30,
            cpus=list(range(i * 48, i * 48 + 48)),
        )
        for i in range(2)
    ]
    return HostFacts(
        hostname="bigmem-01",
        memory_total_bytes=1536 * 2**30,
        memory_available_bytes=1400 * 2**30,
        swap_total_bytes=0,
        cgroup_limit_bytes=None,
        cgroup_version=2,
        logical_cpus=96,
        physical_cores=48,
        usable_cpus=list(range(96)),
        numa_nodes=nodes,
    )


def test_the_template_set_is_found_and_listed():
    assert templates_dir().samefile(REPO / "templates")
    assert {"train.yaml.j2", "runtime.env.j2"} <= set(list_templates())


def test_the_package_carries_the_templates():
    # src/bigmem_train/templates links to the repo's templates/, so a wheel (pip install .) holds them.
    packaged = Path(bigmem_train.__file__).parent / "templates"
    assert (packaged / "train.yaml.j2").is_file() and (packaged / "runtime.env.j2").is_file()


def test_rendered_train_config_is_a_valid_config_sized_to_the_host(tmp_path):
    variables = host_variables(two_node_host()) | parse_variables(
        [
            "dataset_path=/data",
            "results_dir=/results",
            "target_footprint=80%",
            "allocator=jemalloc",
            "epochs=3",
        ]
    )
    out = tmp_path / "train.yaml"
    out.write_text(render("train.yaml.j2", variables))
    config = load_config(out)
    assert config.data.source == "decathlon" and str(config.data.path) == "/data"
    assert config.runtime.intra_op_threads == 48  # one per physical core
    assert config.runtime.inter_op_threads == 1
    assert config.runtime.numa_policy == "auto"  # two nodes: the planner binds or interleaves
    assert config.runtime.allocator == "jemalloc"
    assert config.footprint.target == "80%"
    assert config.training.epochs == 3
    assert str(config.output.results_dir) == "/results"


def test_default_render_is_the_small_synthetic_job(tmp_path):
    out = tmp_path / "train.yaml"
    out.write_text(render("train.yaml.j2", {"physical_cores": 2, "numa_node_count": 1}))
    config = load_config(out)
    default = load_config()
    assert config.data.source == "synthetic"
    assert config.data.input_shape == default.data.input_shape
    assert config.model == default.model
    assert config.training.batch_size == default.training.batch_size
    assert config.runtime.numa_policy == "none"
    assert config.footprint.target is None
    assert config.training.strategy == "single"


def test_rendered_multi_worker_job_says_so(tmp_path):
    # The train role reads training.strategy from this text to start one container per host.
    out = tmp_path / "train.yaml"
    out.write_text(
        render(
            "train.yaml.j2",
            {"physical_cores": 2, "numa_node_count": 1, "strategy": "multi_worker", "batch_size": 4},
        )
    )
    config = load_config(out)
    assert config.training.strategy == "multi_worker" and config.training.batch_size == 4
    assert config.training.worker_heartbeat_timeout == 60

    out.write_text(
        render(
            "train.yaml.j2",
            {
                "physical_cores": 2,
                "numa_node_count": 1,
                "strategy": "multi_worker",
                "batch_size": 4,
                "worker_heartbeat_timeout": "300",
            },
        )
    )
    assert load_config(out).training.worker_heartbeat_timeout == 300


@pytest.mark.parametrize(
    "allocator, line",
    [
        ("jemalloc", "MALLOC_CONF="),
        ("tcmalloc", "TCMALLOC_"),
        ("glibc", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"),
    ],
)
def test_runtime_env_sets_threads_allocator_and_onednn(allocator, line):
    text = render("runtime.env.j2", host_variables(two_node_host()) | {"allocator": allocator})
    env = dict(row.split("=", 1) for row in text.splitlines() if row and not row.startswith("#"))
    assert env["TF_ENABLE_ONEDNN_OPTS"] == "1"
    assert env["TF_NUM_INTRAOP_THREADS"] == env["OMP_NUM_THREADS"] == "48"
    assert env["BIGMEM_ALLOCATOR"] == allocator
    assert line in text


def test_bad_values_and_names_are_refused_with_one_line():
    with pytest.raises(BadInput, match="training.epochs"):
        render("train.yaml.j2", {"epochs": 0})
    with pytest.raises(BadInput, match="not found"):
        render("nope.j2", {})
    with pytest.raises(BadInput, match="^--var 'epochs': expected KEY=VALUE"):
        parse_variables(["epochs"])
    # Values are not coerced: a word or a fraction where a whole number belongs is named, not read as 0 or 2.
    with pytest.raises(BadInput, match="training.epochs: Input should be a valid integer, unable to parse"):
        render("train.yaml.j2", {"epochs": "abc"})
    with pytest.raises(BadInput, match="training.batch_size: Input should be a valid integer, got a number"):
        render("train.yaml.j2", {"batch_size": 2.5})
    with pytest.raises(BadInput, match="validation.dice_floor"):
        render("train.yaml.j2", {"dice_floor": "high"})
    # A number given as text (inventory.ini's values are text) is still that number.
    assert '  epochs: "3"\n' in render("train.yaml.j2", {"epochs": "3"})


def test_cli_render_writes_a_config_the_cli_accepts(tmp_path, capsys):
    out = tmp_path / "job" / "train.yaml"
    assert main(["render", "--var", "epochs=2", "--var", "results_dir=/results", "--out", str(out)]) == 0
    assert load_config(out).training.epochs == 2
    assert main(["render", "--list"]) == 0
    assert "train.yaml.j2" in capsys.readouterr().out
    assert main(["render", "--var", "batch_size=-1"]) == 2


def test_a_variable_the_template_does_not_read_is_refused_naming_the_closest(capsys):
    # Without the check, batchsize=16 rendered the default batch without a word.
    assert main(["render", "--var", "batchsize=16", "--var", "epochs=2"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "bigmem-train: error: --var: 'batchsize' (did you mean 'batch_size'?) is not read by train.yaml.j2, "
        "so it would change nothing (the variables: templates/README.md)"
    )
    assert main(["render", "runtime.env.j2", "--var", "batch_size=2"]) == 2
    assert "'batch_size' is not read by runtime.env.j2" in capsys.readouterr().err


def test_the_job_variables_are_what_the_templates_read_and_readme_documents():
    known = template_names(templates_dir(), JOB_TEMPLATES)
    assert {"batch_size", "epochs", "input_shape", "strategy", "worker_heartbeat_timeout"} <= known
    assert not {"cores", "nodes"} & known, "variables a template sets are not the caller's"
    readme = (REPO / "templates" / "README.md").read_text()
    host_facts = set(host_variables(two_node_host())) | {"dataset_path", "results_dir"}
    undocumented = sorted(name for name in known - host_facts if f"`{name}`" not in readme)
    assert not undocumented, f"templates/README.md does not document {undocumented}"
    with pytest.raises(BadInput, match=r"'epoch' \(did you mean 'epochs'\?\), 'zzz' are not read by"):
        check_variable_names({"epoch": 3, "zzz": 1, "depth": 3}, known, "job", JOB_TEMPLATES)


def test_templates_dir_can_be_overridden(tmp_path, monkeypatch):
    shutil.copy(REPO / "templates" / "runtime.env.j2", tmp_path / "custom.env.j2")
    monkeypatch.setenv("BIGMEM_TEMPLATES_DIR", str(tmp_path))
    assert list_templates() == ["custom.env.j2"]
    monkeypatch.setenv("BIGMEM_TEMPLATES_DIR", str(tmp_path / "missing"))
    with pytest.raises(BadInput, match="BIGMEM_TEMPLATES_DIR"):
        templates_dir()


@pytest.mark.skipif(
    not ANSIBLE_PLAYBOOK.exists(), reason="ansible-playbook not installed (pip install '.[ops]')"
)
def test_ansible_renders_the_same_text(tmp_path):
    """One source of truth: Ansible's template lookup (the train role's) gives the CLI's bytes."""
    variables = host_variables(two_node_host()) | {
        "dataset_path": "/data",
        "results_dir": "/results",
        "target_footprint": "900GiB",
        "allocator": "tcmalloc",
        "epochs": 3,
        "batch_size": 4,
        "dice_floor": 0.6,
        "safety_margin": 0.15,
    }
    (tmp_path / "vars.json").write_text(json.dumps({"template_variables": variables}))
    playbook = tmp_path / "render.yml"
    playbook.write_text(f"""
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.copy:
        content: "{{{{ lookup('ansible.builtin.template', '{REPO}/templates/' ~ item, template_vars=template_variables) }}}}"
        dest: "{tmp_path}/{{{{ item }}}}.out"
        mode: "0644"
      loop: [train.yaml.j2, runtime.env.j2]
""")
    result = subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "-c",
            "local",
            "-i",
            "localhost,",
            "-e",
            f"@{tmp_path}/vars.json",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(playbook),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("train.yaml.j2", "runtime.env.j2"):
        assert (tmp_path / f"{name}.out").read_text().strip() == render(name, variables).strip()
