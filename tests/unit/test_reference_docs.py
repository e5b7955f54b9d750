"""The generated reference pages (docs/reference/{config,ansible-variables,cli}.md) match the code they are
generated from: the pydantic schema, the roles' argument specs and defaults, the argparse parser."""

import importlib.util
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["config.md", "ansible-variables.md", "cli.md"])
def test_reference_page_is_generated_from_the_code(generator, page):
    checked_in = (REPO / "docs" / "reference" / page).read_text()
    assert checked_in == generator.PAGES[page](), (
        f"docs/reference/{page} differs from the code: regenerate it with `{generator.COMMAND}`"
    )


def test_every_config_key_and_role_variable_is_listed(generator):
    from bigmem_train.config import Config

    config_page = generator.config_reference()
    for section, field in Config.model_fields.items():
        for name in field.annotation.model_fields:
            assert f"| `{section}.{name}` |" in config_page
    variables = generator.ansible_reference()
    for defaults in (REPO / "ansible" / "roles").glob("*/defaults/main.yml"):
        for name in yaml.safe_load(defaults.read_text()) or {}:
            assert f"| `{name}` |" in variables, f"{name} ({defaults}) is not in meta/argument_specs.yml"
