"""The plots' one matplotlib setup, shared by report.html and evaluation.html."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (servers and containers have no display).

    Imported here, not at the top: the backend must be chosen before pyplot loads, and only a process
    that writes a report should make that choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
