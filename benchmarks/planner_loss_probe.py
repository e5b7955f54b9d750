"""What the study's loss holds: the resident memory of the loss's forward and backward alone, for one and
for several output classes, in full-size float32 tensors of one output channel.

The planner counts ``LOSS_KEPT_TENSORS`` (7) float32 tensors per output channel for the loss
(0.7 * -log soft Dice + 0.3 * cross-entropy, model.make_loss). Those are the binary loss's: the cast
label, clip(p), 1 - clip, log(clip), log(1 - clip), 1 - label and the Dice product's operands. With
several classes the loss takes another branch (softmax cross-entropy over the one-hot label, Dice over
the foreground classes only), which keeps different tensors. This measures both, each call as the rise
of the RSS high-water mark (VmHWM, reset with clear_refs) over the RSS before it, after tcmalloc handed
its free pages back, three calls per case (the first traces): once with the study's loss and once with a
loss that keeps nothing (the mean of the activation), so that the difference is what the loss itself
holds at its peak, on top of the activation's output, its gradient and the logits' gradient.

    python benchmarks/planner_loss_probe.py --shape 240,240,144 --classes 1,2,4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys


def _step(tf, loss_fn, activation, logits, labels):
    """The loss's forward and backward on its own, as a tf.function: the gradient of the logits."""

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, activation(logits))
        return tape.gradient(loss, logits)

    return step


def probe(shape: tuple[int, int, int], batch: int, class_counts: list[int]) -> None:
    import tensorflow as tf

    from bigmem_train.memory.calibrate import status_bytes
    from bigmem_train.memory.estimate import loss_kept_tensors
    from bigmem_train.model.unet import make_loss

    sys.path.insert(0, os.path.dirname(__file__))
    from planner_layer_probe import _release_and_reset

    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(-1)  # ops inline, as a single-host run
    voxels = batch
    for edge in shape:
        voxels *= edge
    channel_mib = voxels * 4 / 2**20
    losses = {"mean": lambda y, p: tf.reduce_mean(p), "study": make_loss()}
    for classes in class_counts:
        activation = tf.sigmoid if classes == 1 else (lambda logits: tf.nn.softmax(logits, axis=-1))
        logits = tf.Variable(tf.random.normal((batch, *shape, classes)))
        if classes == 1:
            labels = tf.cast(tf.random.uniform((batch, *shape, 1)) < 0.05, tf.float32)
        else:
            labels = tf.cast(
                tf.random.uniform((batch, *shape, 1), maxval=classes, dtype=tf.int32), tf.float32
            )
        result = {
            "classes": classes,
            "shape": list(shape),
            "batch": batch,
            "channel_MiB": round(channel_mib, 1),
        }
        for name, loss_fn in losses.items():
            step = _step(tf, loss_fn, activation, logits, labels)
            rises = []
            for _ in range(3):
                gc.collect()
                _release_and_reset()
                before = status_bytes("VmRSS")
                gradient = step()
                gradient.numpy().ravel()[:1]
                rises.append((status_bytes("VmHWM") - before) / 2**20)
                del gradient
            result[f"{name}_MiB"] = [round(rise, 1) for rise in rises]
        # The first call traces: the loss's share is the difference of the later calls' lowest rises.
        loss_mib = min(result["study_MiB"][1:]) - min(result["mean_MiB"][1:])
        result["loss_MiB"] = round(loss_mib, 1)
        result["loss_channel_tensors"] = round(loss_mib / channel_mib, 2)
        result["planned_channel_tensors"] = loss_kept_tensors(classes)
        print(json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="240,240,144")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--classes", default="1,2,4")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(edge) for edge in args.shape.split(","))
    class_counts = [int(count) for count in args.classes.split(",")]
    if args.child:
        probe(shape, args.batch, class_counts)  # type: ignore[arg-type]
        return 0
    from bigmem_train.config import load_config
    from bigmem_train.train.launch import runtime_environment

    environment = dict(runtime_environment(load_config()), TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], env=environment).returncode


if __name__ == "__main__":
    sys.exit(main())
