"""What TensorFlow holds vs what the process holds, in one bare training step, plain and recomputed.

For the U-Net at a shape (16 filters by default, depth 4, batch 2), one child process per mode runs the
training step three times under the kit's runtime (tcmalloc preloaded, ops inline) and records:

- TensorFlow's live peak: the profiler's memory events (``MemoryAllocation`` / ``MemoryDeallocation``,
  requested bytes) of the third step, replayed to the largest set of tensors alive at once, with the ops
  that own the largest of them. TensorFlow's own tensor allocator emits these events and the system
  allocator does not, so this child runs with TensorFlow's allocator (the tensors requested are the same);
- the resident rise: the RSS high-water mark (VmHWM, reset before the steps) over the RSS before them, in
  a second child with the kit's runtime as it is;
- the walk: ``estimate.backward_live_bytes`` for the same model (the planner's tensors alive at the peak).

docs/planner.md ("Gradient recomputation") has the table this printed for 96x96x64 and 160x160x112.

    python benchmarks/planner_recompute_probe.py --shape 160,160,112 --batch 2 --filters 16
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

MODES = ("plain", "recomputed")


def child(shape: tuple[int, int, int], batch: int, filters: int, recompute: bool) -> dict:
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(int(os.environ.get("PROBE_INTRA", "2")))
    tf.config.threading.set_inter_op_parallelism_threads(-1)  # ops inline, as a single-host run
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from bigmem_train.config import load_config
    from bigmem_train.memory.calibrate import reset_peak, status_bytes
    from bigmem_train.model.unet import build_unet

    config = load_config(
        None, {"model.depth": 4, "model.base_filters": filters, "model.recompute": recompute}
    )
    model = build_unet(config.model, shape, 1)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    x = tf.random.normal((batch, *shape, 1))
    y = tf.cast(tf.random.uniform((batch, *shape, 1)) > 0.5, tf.float32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.binary_crossentropy(y, model(x, training=True)))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    before = status_bytes("VmRSS")
    reset_peak()
    step().numpy()
    step().numpy()
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        step().numpy()
        tf.profiler.experimental.stop()
        rise = status_bytes("VmHWM") - before
        space = xplane_pb2.XSpace()
        path = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))[-1]
        with open(path, "rb") as stream:
            space.ParseFromString(stream.read())
    events = []
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        stat_names = {key: value.name for key, value in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = names.get(event.metadata_id, "")
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for stat in event.stats:
                    stats[stat_names.get(stat.metadata_id, "")] = (
                        stat.int64_value
                        or stat.uint64_value
                        or stat.str_value
                        or (stat_names.get(stat.ref_value) if stat.ref_value else None)
                    )
                events.append((line.timestamp_ns + event.offset_ps // 1000, kind, stats))
    events.sort(key=lambda item: item[0])
    live: dict = {}
    peak, at_peak = 0, {}
    for _, kind, stats in events:
        if kind == "MemoryAllocation":
            live[stats.get("addr")] = (int(stats.get("requested_bytes") or 0), str(stats.get("tf_op")))
        else:
            live.pop(stats.get("addr"), None)
        total = sum(size for size, _ in live.values())
        if total > peak:
            peak, at_peak = total, dict(live)
    owners: dict[str, int] = {}
    for size, op in at_peak.values():
        owners[op] = owners.get(op, 0) + size
    largest = sorted(owners.items(), key=lambda item: -item[1])[:8]
    return {"tensorflow_live_peak_bytes": peak, "resident_rise_bytes": rise, "largest_at_peak": largest}


def walk(shape: tuple[int, int, int], batch: int, filters: int, recompute: bool) -> int:
    from bigmem_train.config import load_config
    from bigmem_train.memory import estimate, layers
    from bigmem_train.memory.calibrate import job_config

    config = job_config(load_config(), shape, batch, filters, 4, 1, recompute=recompute)
    table = layers.expand_recomputed_blocks(layers.layer_table(config), config.model.batch_norm)
    return estimate.backward_live_bytes(table, batch, shape, recompute)[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="96,96,64")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--filters", type=int, default=16)
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="which steps to probe (default: both)"
    )
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(edge) for edge in args.shape.split(","))
    if args.child:
        print(json.dumps(child(shape, args.batch, args.filters, args.child == "recomputed")))
        return 0
    from bigmem_train.config import load_config
    from bigmem_train.train.launch import runtime_environment

    environment = dict(runtime_environment(load_config()), TF_CPP_MIN_LOG_LEVEL="3")
    print("| step | TensorFlow's live peak | the walk | resident rise | resident / live |")
    print("|---|---:|---:|---:|---:|")
    profiled = {key: value for key, value in environment.items() if key != "TF_ONEDNN_USE_SYSTEM_ALLOCATOR"}
    for mode in args.modes:
        events, resident = (
            json.loads(
                subprocess.run(
                    [sys.executable, __file__, *sys.argv[1:], "--child", mode],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            for env in (profiled, environment)
        )
        live, rise = events["tensorflow_live_peak_bytes"], resident["resident_rise_bytes"]
        walked = walk(shape, args.batch, args.filters, mode == "recomputed")
        print(
            f"| {'x'.join(map(str, shape))} b{args.batch} f{args.filters}, {mode} | {live / 1e6:,.0f} MB "
            f"| {walked / 1e6:,.0f} MB | {rise / 1e6:,.0f} MB | {rise / live:.2f} |",
            flush=True,
        )
        for op, size in events["largest_at_peak"]:
            print(f"    {size / 1e6:9.1f} MB  {op}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
