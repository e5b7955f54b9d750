"""Scale-out on loopback: two `bigmem-train run` workers with TF_CONFIG rendered from the template
(ports on 127.0.0.1) train together, end with identical weights, and the chief's verdict passes.

The validation set does not divide evenly across the workers (3 cases, global batch 2): before the
validation pass was filled to whole global batches, worker 1 got an empty batch at the first
validation, failed on it, and the chief aborted in the next all-reduce."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bigmem_train.distribute import parse_tf_config, render_tf_config
from tests.fixtures.common import free_port, write_tiny_job

pytestmark = pytest.mark.slow


def load_weights(path):
    """The weights of a saved .keras checkpoint as numpy arrays (no compile needed)."""
    import keras

    import bigmem_train.model  # noqa: F401  (registers the kit's layers, which the archive names)

    model = keras.saving.load_model(path, compile=False)
    return [np.asarray(weight) for weight in model.get_weights()]


def assert_trained_in_lockstep(chief, worker):
    """Two workers' run directories of one job: the same losses (the logs are averaged across workers)
    and the same final weights."""
    assert (chief / "history.csv").read_text() == (worker / "history.csv").read_text()
    chief_weights = load_weights(chief / "checkpoints" / "last.keras")
    worker_weights = load_weights(worker / "checkpoints" / "last.keras")
    assert len(chief_weights) == len(worker_weights) > 0
    for mine, theirs in zip(chief_weights, worker_weights):
        np.testing.assert_array_equal(mine, theirs)


def test_two_workers_train_in_lockstep(tmp_path):
    ports = [free_port(), free_port()]
    groups = {"workers": ["w0", "w1"]}
    hostvars = {
        name: {"ansible_host": "127.0.0.1", "bigmem_train_worker_port": port}
        for name, port in zip(groups["workers"], ports)
    }
    # 12 cases: the split gives 9 training, 3 validation; evened to 8 and 4 for two workers (batch 2).
    config = write_tiny_job(tmp_path / "job.yaml", epochs=2, strategy="multi_worker", cases=12)
    processes = []
    for index, name in enumerate(groups["workers"]):
        tf_config = render_tf_config(groups, hostvars, name, "workers")
        assert parse_tf_config(tf_config).index == index
        # Each worker has its own results folder, as two hosts would.
        results = tmp_path / name
        environment = {
            **os.environ,
            "TF_CONFIG": tf_config,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "OMP_NUM_THREADS": "1",
        }
        log = open(tmp_path / f"{name}.log", "w")
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bigmem_train.cli",
                    "run",
                    "--config",
                    str(config),
                    "--results",
                    str(results),
                    "--run-name",
                    "mw",
                    "--set",
                    "runtime.intra_op_threads=1",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
            )
        )
    try:
        codes = [process.wait(timeout=600) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in groups["workers"]}
    assert codes == [0, 0], "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in logs.items())

    chief, worker = tmp_path / "w0" / "mw", tmp_path / "w1" / "mw.worker1"
    assert json.loads((chief / "verdict.json").read_text())["verdict"] == "PASS"
    assert "PASS" in logs["w0"] and "TRAINED" in logs["w1"]
    assert not (worker / "verdict.json").exists(), "only the chief validates and reports"
    for run in (chief, worker):
        assert json.loads((run / "state.json").read_text())["state"] == "finished"
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["strategy"] == "multi_worker" and metrics["workers"] == 2
        # The split's 3 validation cases became 4 (one training case moved over): whole global batches,
        # nothing repeated, the same split on both workers.
        assert (metrics["validation_cases"], metrics["validation_padded_samples"]) == (4, 0)
        split = json.loads((run / "split.json").read_text())
        assert (len(split["train"]), len(split["validation"])) == (8, 4)
    assert_trained_in_lockstep(chief, worker)
    # The weights moved: this was training, not two copies of the initial model.
    initial_loss = json.loads((chief / "metrics.json").read_text())["initial_loss"]
    assert initial_loss > json.loads((chief / "metrics.json").read_text())["final_loss"]
