"""oneDNN's Conv3D backward-weights scratchpad: measured on the op alone vs the planner's formula.

Under oneDNN (the default runtime) every 3x3x3 Conv3D's filter gradient runs oneDNN's gemm kernel
(``x64:gemm:jit``, ``ONEDNN_VERBOSE=1`` shows it), which books a scratchpad of a transposed copy of one
input sample + the im2col patches of one output depth slice, per thread when it threads over the batch
(``memory.estimate.onednn_scratchpad_bytes``). oneDNN keeps it in a per-thread buffer that lives as long as the
cached primitives, so the first call's rise stays for the whole run.

Each case runs in its own process under the run's runtime (oneDNN on, tcmalloc preloaded when
installed, 2 intra-op / 1 inter-op threads): ``tf.raw_ops.Conv3DBackpropFilterV2`` three times, each
time the rise of VmHWM (reset with clear_refs) over the RSS before the call. The output (the filter
gradient) is a few KiB, so the first call's rise is the scratchpad plus the kernel's own memory
(about 11 MiB); the later calls rise by 0 (the buffer is reused).

    python benchmarks/planner_conv_scratchpad.py              # the cases below, one process each
    python benchmarks/planner_conv_scratchpad.py --case 1,144,240,240,32,16   # this case only (repeatable)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# (batch, depth, height, width, input channels, output channels); 2 threads
CASES = [
    (1, 160, 152, 104, 16, 8),  # the top up block's first conv of the 160x152x104 f8 job
    (1, 160, 152, 104, 8, 8),
    (4, 96, 96, 96, 16, 8),  # batch 4: still one sample's copy
    (2, 128, 128, 128, 16, 8),
    (1, 192, 192, 128, 16, 8),
    (1, 1024, 16, 16, 32, 32),  # small slices: 128 rows per thread ...
    (2, 1024, 16, 16, 32, 32),  # ... and batch > 1: one copy per thread
    (2, 1024, 32, 32, 32, 32),  # 512 rows per thread: one copy
]
THREADS = 2
MiB = 2**20


def child(case: tuple[int, ...]) -> dict:
    import tensorflow as tf

    from bigmem_train.memory.calibrate import reset_peak, status_bytes

    batch, depth, height, width, cin, cout = case
    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    inputs = tf.random.normal((batch, depth, height, width, cin))
    gradient = tf.random.normal((batch, depth, height, width, cout))

    @tf.function
    def filter_gradient(x, g):
        return tf.raw_ops.Conv3DBackpropFilterV2(
            input=x,
            filter_sizes=[3, 3, 3, cin, cout],
            out_backprop=g,
            strides=[1, 1, 1, 1, 1],
            padding="SAME",
        )

    rises = []
    for _ in range(3):
        reset_peak()
        before = status_bytes("VmRSS")
        filter_gradient(inputs, gradient).numpy()
        rises.append(round((status_bytes("VmHWM") - before) / MiB, 1))
    return {"rise_MiB": rises}


def formula_bytes(case: tuple[int, ...]) -> int:
    from bigmem_train.memory.estimate import onednn_scratchpad_bytes

    batch, depth, height, width, cin, cout = case
    table = [
        {
            "name": "x",
            "kind": "InputLayer",
            "inputs": [],
            "divisor": [1, 1, 1],
            "channels": cin,
            "dtype": "float32",
            "kernel_dtype": "float32",
            "kernel_size": [],
        },
        {
            "name": "conv",
            "kind": "Conv3D",
            "inputs": ["x"],
            "divisor": [1, 1, 1],
            "channels": cout,
            "dtype": "float32",
            "kernel_dtype": "float32",
            "kernel_size": [3, 3, 3],
        },
    ]
    return onednn_scratchpad_bytes(table, batch, (depth, height, width), threads=THREADS)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(tuple(json.loads(sys.argv[2])))))
        return 0
    cases = CASES
    if "--case" in sys.argv:
        cases = [
            tuple(int(part) for part in sys.argv[index + 1].split(","))
            for index, word in enumerate(sys.argv)
            if word == "--case"
        ]
        if any(len(case) != 6 for case in cases):
            raise SystemExit("--case takes batch,depth,height,width,in_channels,out_channels")
    from bigmem_train.config import load_config
    from bigmem_train.train.launch import runtime_environment

    env = dict(runtime_environment(load_config()), TF_CPP_MIN_LOG_LEVEL="3")
    print(
        f"runtime: TF_ENABLE_ONEDNN_OPTS={env.get('TF_ENABLE_ONEDNN_OPTS')}, "
        f"LD_PRELOAD={Path(env['LD_PRELOAD']).name if env.get('LD_PRELOAD') else '(none)'}, {THREADS} threads"
    )
    print(
        "| batch x D x H x W, channels in -> out | first call rise MiB | later calls | formula MiB | rise - formula |"
    )
    print("|---|---:|---:|---:|---:|")
    for case in cases:
        result = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(case)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if result.returncode != 0:
            print(f"| {case} | failed: {result.stderr.strip().splitlines()[-1:]} |")
            continue
        rises = json.loads(result.stdout.strip().splitlines()[-1])["rise_MiB"]
        formula = formula_bytes(case) / MiB
        batch, depth, height, width, cin, cout = case
        print(
            f"| {batch}x{depth}x{height}x{width}, {cin} -> {cout} | {rises[0]:.0f} "
            f"| {rises[1]:.0f}, {rises[2]:.0f} | {formula:.1f} | {rises[0] - formula:+.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.exit(main())
