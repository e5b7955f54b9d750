"""The variable names the shared templates read, so that a job variable no template reads is refused
instead of silently ignored (``--var batchsize=16`` would otherwise train the default batch).

Needs only Jinja2 and the standard library: Ansible's filter plugin imports it on a controller where the
kit itself may not be installed.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

import jinja2
import jinja2.meta

from bigmem_train.errors import BadInput

# The templates a job's variables are for (Ansible's train role renders both from bigmem_train_job).
JOB_TEMPLATES = ("train.yaml.j2", "runtime.env.j2")


def template_names(directory: Path, names: Iterable[str]) -> set[str]:
    """Every variable the templates ``names`` in ``directory`` read from their caller (not those they set)."""
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(directory)))
    used: set[str] = set()
    for name in names:
        source = (Path(directory) / name).read_text()
        used |= jinja2.meta.find_undeclared_variables(environment.parse(source))
    return used


def check_variable_names(given: Iterable[str], known: set[str], what: str, templates: Iterable[str]) -> None:
    """BadInput naming every variable in ``given`` that the ``templates`` (which read ``known``) do not
    read, with the closest known name."""
    unknown = sorted(set(given) - known)
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise BadInput(
        f"{what}: {', '.join(parts)} {'is' if len(unknown) == 1 else 'are'} not read by "
        f"{' or '.join(templates)}, so {'it' if len(unknown) == 1 else 'they'} would change nothing "
        "(the variables: templates/README.md)"
    )
