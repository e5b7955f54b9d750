"""Memory sizes with units: ``64GiB``, ``1TB``, ``900 GB``, ``80%`` (of the host), plain bytes."""

from __future__ import annotations

import re

from bigmem_train.errors import BadInput

GIB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_size(text: str | int | float, host_total_bytes: int | None = None) -> int:
    """Parse a size into bytes.

    A percentage needs ``host_total_bytes``. Raises :class:`BadInput` with the offending text.
    """
    if isinstance(text, bool):
        raise BadInput(f"size {text!r} is not a size")
    if isinstance(text, (int, float)):
        if text < 0:
            raise BadInput(f"size {text!r} is negative")
        return int(text)
    match = _SIZE_RE.match(str(text))
    if not match:
        raise BadInput(f"size {text!r} is not a size (use e.g. 64GiB, 1TB, 900GB or 80%)")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise BadInput(f"size {text!r}: a share of the host must be between 0% and 100%")
        if host_total_bytes is None:
            raise BadInput(f"size {text!r} is a share of the host, but the host memory is unknown")
        return int(host_total_bytes * number / 100)
    if unit not in _UNITS:
        raise BadInput(
            f"size {text!r} has an unknown unit {match.group(2)!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %)"
        )
    return int(number * _UNITS[unit])


def format_bytes(num_bytes: int | float) -> str:
    """``12884901888 B (12.00 GiB)``: reports print both bytes and GiB."""
    return f"{int(num_bytes)} B ({num_bytes / GIB:.2f} GiB)"


def gib(num_bytes: int | float) -> float:
    return round(num_bytes / GIB, 3)
