"""Helpers for the remote and multi-worker tests: a tiny job config and an inventory for the test sshd."""

from pathlib import Path

import pytest

# Small enough for two CPU cores: 8 cases of 24x24x16 cropped to 16x16x16, a depth-2 U-Net of 4 filters.
# 6 training cases at batch 2 (3 steps an epoch), 2 validation cases (one batch, split evenly by 2 workers).
TINY_JOB = """\
data:
  source: synthetic
  synthetic_cases: {cases}
  synthetic_shape: [24, 24, 16]
  input_shape: [16, 16, 16]
  crop_jitter: 2
  parallel_reads: 1
model:
  depth: 2
  base_filters: 4
training:
  batch_size: 2
  epochs: {epochs}
  learning_rate: 0.01
  strategy: {strategy}
validation:
  dice_floor: 0.0
output:
  tensorboard: false
  sample_interval: 0.5
"""


def write_job(path: Path, epochs: int = 2, strategy: str = "single", cases: int = 8) -> Path:
    path.write_text(TINY_JOB.format(epochs=epochs, strategy=strategy, cases=cases))
    return path


@pytest.fixture
def tiny_job(tmp_path) -> Path:
    return write_job(tmp_path / "tiny.yaml")
