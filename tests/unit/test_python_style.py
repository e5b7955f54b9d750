"""The Python tree is clean under the linter and formatter configured in pyproject.toml (ruff)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def ruff(*argv: str) -> subprocess.CompletedProcess:
    if not RUFF.exists():
        pytest.skip("ruff not installed (bash scripts/setup.sh --test)")
    return subprocess.run([str(RUFF), *argv], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint_is_clean():
    result = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_ruff_format_is_clean():
    result = ruff("format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
