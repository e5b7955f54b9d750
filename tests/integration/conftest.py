"""Helpers for tests that run the real `bigmem-train` CLI in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY_JOB = """\
data:
  source: synthetic
  synthetic_cases: 10
  synthetic_shape: [40, 40, 28]
  input_shape: [32, 32, 16]
  crop_jitter: 2
model:
  depth: 2
  base_filters: 8
training:
  batch_size: 2
  epochs: {epochs}
  learning_rate: 0.003
validation:
  dice_floor: 0.5
output:
  results_dir: {results}
  tensorboard: false
"""


def bigmem(*args, cwd=None, timeout=900, env=None):
    """Run the CLI as a user would; returns the CompletedProcess (text)."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([sys.executable, "-m", "bigmem_train.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=environment)


@pytest.fixture
def tiny_job(tmp_path) -> Path:
    """Write a tiny synthetic job config (epochs adjustable via --set)."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_JOB.format(epochs=6, results=tmp_path / "results"))
    return path
