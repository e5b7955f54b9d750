"""The commands behind ``bigmem-train``: each takes parsed arguments, calls the stages, prints for a
person (or JSON for scripts) and returns the exit code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bigmem_train.cli.output import format_host, format_plan, host_summary
from bigmem_train.config import Config
from bigmem_train.data.synth import write_synthetic_dataset
from bigmem_train.errors import EXIT_FAIL, EXIT_PASS, BadInput
from bigmem_train.host import read_host_facts
from bigmem_train.memory.calibrate import calibrate
from bigmem_train.memory.constants import load_calibration
from bigmem_train.memory.levers import levers_to_fit
from bigmem_train.memory.plan import allowance, plan_job
from bigmem_train.memory.preflight import check_fits, usable_bytes
from bigmem_train.ops.render import host_variables, list_templates, parse_variables, render, templates_dir
from bigmem_train.ops.template_names import check_variable_names, template_names
from bigmem_train.pipeline import run_job
from bigmem_train.sizes import format_bytes, gib
from bigmem_train.verdict.report import write_report
from bigmem_train.verdict.validate import format_verdict, validate_run


def run_command(config: Config, validate_and_report: bool) -> int:
    """``bigmem-train run`` / ``train``: the whole job (see :func:`bigmem_train.pipeline.run_job`)."""
    return run_job(config, validate_and_report=validate_and_report)


def plan_command(config: Config, as_json: bool, calibrate_first: bool) -> int:
    """``bigmem-train plan``: print the breakdown (and the sized job with a target)."""
    if calibrate_first:
        path = calibrate(config, log=None if as_json else print)
        if not as_json:
            print(f"calibration stored: {path}")
    host = read_host_facts()
    plan = plan_job(config, host, to_run_here=False)  # may plan for a larger host; says whether it fits here
    usable = usable_bytes(plan, host)
    levers = []
    if plan.peak_bytes > usable:
        levers = levers_to_fit(plan.config, usable, load_calibration(), host.cpu_flags)
    if as_json:
        print(
            json.dumps(
                {
                    **plan.to_dict(),
                    "usable_bytes": usable,
                    "fits_this_host": plan.peak_bytes <= usable,
                    "levers": [
                        {
                            "change": lever.change,
                            "peak_bytes": lever.peak_bytes,
                            "step_time_factor": lever.step_time_factor,
                            "why": lever.why,
                        }
                        for lever in levers
                    ],
                },
                indent=2,
            )
        )
        return 0
    print(format_plan(plan))
    if plan.peak_bytes > usable:
        print(
            f"this host: {format_bytes(usable)} usable: the job does not fit here; what would make it fit, "
            "cheapest first:"
            if levers
            else f"this host: {format_bytes(usable)} usable: the job does not fit "
            "here, and no lever makes it fit"
        )
        for number, lever in enumerate(levers, 1):
            print(f"  ({number}) {lever.describe()}")
    else:
        print(f"this host: {format_bytes(usable)} usable: fits")
    return 0


def preflight_command(config: Config, as_json: bool) -> int:
    """``bigmem-train preflight``: print host facts and the fit decision; exit 3 when it does not fit."""
    host = read_host_facts()
    plan = plan_job(config, host)
    usable = usable_bytes(plan, host)
    fits = plan.peak_bytes <= usable
    if as_json:
        print(
            json.dumps(
                {
                    "host": host_summary(host),
                    "plan": plan.to_dict(),
                    "usable": {"bytes": usable, "gib": gib(usable)},
                    "fits": fits,
                },
                indent=2,
            )
        )
    else:
        print(format_host(host))
        print(
            f"plan: peak {format_bytes(plan.peak_bytes)}, usable {format_bytes(usable)} "
            f"({allowance(plan.config, host).why}); placement {plan.placement.policy}"
        )
    check_fits(plan, host)
    if not as_json:
        print("fits: yes")
    return 0


def validate_command(run_dir: Path) -> int:
    """``bigmem-train validate RUN_DIR``: exit 0 PASS, 1 FAIL."""
    verdict = validate_run(run_dir)
    print(format_verdict(verdict))
    return EXIT_PASS if verdict.passed else EXIT_FAIL


def report_command(run_dir: Path) -> int:
    print(f"report: {write_report(run_dir)}")
    return 0


def synth_command(out: Path, cases: int, shape_text: str, seed: int) -> int:
    shape = parse_shape(shape_text)
    if cases < 1:
        raise BadInput(f"--cases {cases}: need at least 1 case")
    path = write_synthetic_dataset(out, cases=cases, shape=shape, seed=seed)
    print(f"synthetic dataset: {path}")
    return 0


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise BadInput(f"--shape {text!r}: expected three integers X,Y,Z") from None
    if len(shape) != 3 or any(edge < 1 for edge in shape):
        raise BadInput(f"--shape {text!r}: expected three positive integers X,Y,Z")
    return shape  # type: ignore[return-value]


def render_command(args: argparse.Namespace) -> int:
    """``bigmem-train render [TEMPLATE] [--var K=V ...] [--out FILE] [--list]``."""
    if args.list:
        for name in list_templates():
            print(name)
        return 0
    variables = host_variables(read_host_facts())
    given = parse_variables(args.variables)
    directory = templates_dir()
    if args.template in list_templates(directory):  # an unknown one gets render's own error
        check_variable_names(given, template_names(directory, [args.template]), "--var", [args.template])
    variables.update(given)
    text = render(args.template, variables)
    if args.out and args.out != "-":
        out = Path(args.out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
        except OSError as error:
            raise BadInput(f"--out {args.out}: {error.strerror}") from None
        print(f"rendered {args.template}: {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
