"""Will the job fit? The memory planner, without TensorFlow at import.

- :mod:`.layers`      the layer table of the configured Keras model (built once in a child process, cached)
- :mod:`.estimate`    the memory model: kept tensors, the backward walk, workspace, the peak's breakdown
- :mod:`.constants`   the machine constants (runtime baseline, activation factor) and their file
- :mod:`.calibrate`   ``plan --calibrate``: measure jobs in child processes and fit the constants
- :mod:`.sizing`      the largest batch or shape within a target
- :mod:`.placement`   NUMA: bind to one node or interleave
- :mod:`.plan`        :class:`JobPlan` and :func:`plan_job`, which puts the above together
- :mod:`.preflight`   :func:`check_fits`: refuse a plan the host cannot hold (exit 3)

``estimate.estimate(config)`` is a job's breakdown as configured. See docs/design/planner.md for the model
and its accuracy.
"""

from bigmem_train.memory.constants import Calibration, load_calibration
from bigmem_train.memory.estimate import breakdown_for
from bigmem_train.memory.layers import layer_table
from bigmem_train.memory.placement import Placement, decide_placement
from bigmem_train.memory.plan import JobPlan, plan_job
from bigmem_train.memory.preflight import check_fits, usable_bytes

__all__ = [
    "Calibration",
    "JobPlan",
    "Placement",
    "breakdown_for",
    "check_fits",
    "decide_placement",
    "layer_table",
    "load_calibration",
    "plan_job",
    "usable_bytes",
]
