"""Render the shared Jinja templates (``templates/*.j2``) with this host's facts: ``bigmem-train render``.

The same templates are rendered by Ansible's train role; both pass the variables documented in
``templates/README.md``: host facts (``hostname``, ``memory_total_bytes``, ``numa_node_count``,
``physical_cores``, ``logical_cpus``) and job variables given as ``--var KEY=VALUE``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
import yaml

from bigmem_train.config import config_from_dict, parse_override
from bigmem_train.errors import BadInput
from bigmem_train.host import HostFacts

TEMPLATES_ENV = "BIGMEM_TEMPLATES_DIR"


def templates_dir() -> Path:
    """The template set: $BIGMEM_TEMPLATES_DIR, else the copy in the package (a link to the repo's
    ``templates/`` in a checkout, real files in an installed wheel), else ``templates/`` beside ``src/``."""
    override = os.environ.get(TEMPLATES_ENV)
    if override:
        path = Path(override)
        if not path.is_dir():
            raise BadInput(f"{TEMPLATES_ENV}={override} is not a folder")
        return path
    for candidate in (
        Path(__file__).parents[1] / "templates",
        Path(__file__).resolve().parents[3] / "templates",
    ):
        if candidate.is_dir() and any(candidate.glob("*.j2")):
            return candidate
    raise BadInput(f"no templates folder found: set {TEMPLATES_ENV} to the kit's templates/ folder")


def list_templates(directory: Path | None = None) -> list[str]:
    return sorted(path.name for path in (directory or templates_dir()).glob("*.j2"))


def host_variables(host: HostFacts) -> dict[str, Any]:
    """The host facts every template may use (Ansible's train role passes the same names)."""
    return {
        "hostname": host.hostname,
        "memory_total_bytes": host.limit_total_bytes,
        "numa_node_count": max(1, len(host.numa_nodes)),
        "physical_cores": host.physical_cores,
        "logical_cpus": host.logical_cpus,
    }


def parse_variables(texts: list[str]) -> dict[str, Any]:
    """``["epochs=3", "dataset_path=/data"]`` -> {"epochs": 3, "dataset_path": "/data"} (values parsed as YAML)."""
    variables = {}
    for text in texts:
        key, value = parse_override(text, flag="--var", example="epochs=3")
        if not key.isidentifier():
            raise BadInput(f"--var {text!r}: {key!r} is not a template variable name")
        variables[key] = value
    return variables


def render(name: str, variables: dict[str, Any], directory: Path | None = None) -> str:
    """Render one template; a rendered job config is validated against the config schema."""
    directory = directory or templates_dir()
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(directory)),
        undefined=jinja2.StrictUndefined,
        # Ansible's template defaults, so that both render the same text.
        trim_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    try:
        template = environment.get_template(name)
    except jinja2.TemplateNotFound:
        raise BadInput(
            f"template {name!r} not found in {directory} (have: {', '.join(list_templates(directory))})"
        ) from None
    try:
        text = template.render(**variables)
    except jinja2.UndefinedError as error:
        raise BadInput(f"template {name}: {error.message} (pass it with --var)") from None
    except (jinja2.TemplateError, TypeError, ValueError) as error:
        raise BadInput(f"template {name}: {error}") from None
    if name.startswith("train.yaml"):
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise BadInput(f"template {name} rendered invalid YAML: {error}") from None
        config_from_dict(raw, source=f"rendered {name}")
    return text
