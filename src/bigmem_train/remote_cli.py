"""`bigmem-train remote ...`: Fabric operations on lab servers (see remote.py)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    remote = sub.add_parser("remote", help="operate jobs on lab servers over SSH (Fabric)")
    remote.add_subparsers(dest="remote_command", metavar="ACTION")


def dispatch(args: argparse.Namespace) -> int:
    from .errors import BadInput

    raise BadInput("remote: give an action (see bigmem-train remote --help)")
