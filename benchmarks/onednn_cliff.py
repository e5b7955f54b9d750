"""oneDNN's filter-gradient cliff (issue 14) on single ops, and the per-layer limit of the U-Net.

Sections (each op in a fresh child process; load average recorded with every figure):

* ``create``: the backward-weights implementation oneDNN creates (``ONEDNN_VERBOSE=profile_create``) for
  shapes just under and over the gemm scratchpad limit, the study's tile layer whole and as the chunk the
  kit runs, next to ``conv.gemm_backward_weights_scratchpad_bytes``; native ISA and ``--isa`` (default
  AVX2, as on the CPU of issue 14). Only primitives are created (the probe kills its child).
* ``time``: the filter gradient of the tile layer up0_conv1 (240x240x144, 32 -> 16): plain
  (TensorFlow's op) against chunked (``conv.chunked_filter_gradient``), per ISA; a plain run past the
  cliff is stopped at ``--ref-timeout`` and reported as a bound.
* ``layers``: each Conv3D of the U-Net at ``--shape``, forward + input gradient + filter gradient as the
  kit runs it (chunked where it chunks), best of ``--repeats``; their sum is the step the convolutions
  alone allow (compare with ``throughput.py``'s measured step).

    python benchmarks/onednn_cliff.py --sections create time
    python benchmarks/onednn_cliff.py --sections layers --shape 96 96 96

Writes ``benchmarks/results/onednn_cliff.json`` (sections merged) and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))

from bigmem_train.model.conv import (  # noqa: E402 (the checkout's src/ first, set just above)
    ConvGeometry,
    gemm_backward_weights_fits,
    gemm_backward_weights_scratchpad_bytes,
    plan_depth_chunk,
    slab_geometry,
)

TILE_LAYER = ConvGeometry((240, 240, 144), 32, 16)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------
# Worker side.


def worker(spec: dict) -> dict:
    import tensorflow as tf

    from bigmem_train.model.conv import chunked_filter_gradient

    if spec.get("threads"):
        tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
        tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = []
    for item in spec["ops"]:
        spatial, cin, cout, kernel = item["spatial"], item["cin"], item["cout"], item["kernel"]
        batch = item.get("batch", 1)
        x = tf.random.normal([batch, *spatial, cin])
        w = tf.random.normal([*kernel, cin, cout]) * 0.05
        dy = tf.random.normal([batch, *spatial, cout])
        chunk = item.get("chunk")
        sizes = [*kernel, cin, cout]

        @tf.function
        def forward(x, w):
            return tf.nn.conv3d(x, w, [1] * 5, "SAME")

        input_sizes = [batch, *spatial, cin]

        @tf.function
        def input_gradient(w, dy, input_sizes=input_sizes):
            return tf.raw_ops.Conv3DBackpropInputV2(
                input_sizes=input_sizes, filter=w, out_backprop=dy, strides=[1] * 5, padding="SAME"
            )

        @tf.function
        def filter_gradient(x, dy, chunk=chunk, sizes=sizes):
            if chunk:
                return chunked_filter_gradient(x, dy, sizes, "same", chunk)
            return tf.raw_ops.Conv3DBackpropFilterV2(
                input=x, filter_sizes=sizes, out_backprop=dy, strides=[1] * 5, padding="SAME"
            )

        ops = {
            "forward": (forward, (x, w)),
            "input_gradient": (input_gradient, (w, dy)),
            "filter_gradient": (filter_gradient, (x, dy)),
        }
        row = {**item}
        for name in item.get("which", list(ops)):
            function, args = ops[name]
            if spec.get("progress"):
                Path(spec["progress"]).write_text(
                    json.dumps({"op": name, "started": time.time(), "item": item})
                )
            function(*args).numpy()  # trace, create the primitive
            times, cpus = [], []
            for _ in range(item.get("repeats", 2)):
                started, cpu = time.perf_counter(), time.process_time()
                function(*args).numpy()
                times.append(time.perf_counter() - started)
                cpus.append(time.process_time() - cpu)
            row[name] = {"best": min(times), "median": statistics.median(times), "cpu_best": min(cpus)}
        rows.append(row)
        del x, w, dy
    return {"rows": rows}


def run_worker(spec: dict, env: dict, timeout: float) -> dict:
    load_before = os.getloadavg()[0]
    with (
        tempfile.NamedTemporaryFile("r", suffix=".json") as out,
        tempfile.NamedTemporaryFile("r", suffix=".progress") as progress,
    ):
        spec = {**spec, "progress": progress.name}
        started = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec), out.name],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            ended = time.time()
            state = json.loads(progress.read() or "{}")
            return {
                "error": "timed out",
                "op": state.get("op"),
                "op_over_seconds": round(ended - state.get("started", started), 1),
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        if proc.returncode:
            return {
                "error": proc.stderr[-1500:],
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        result = json.loads(Path(out.name).read_text())
    result.update(
        {
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "process_seconds": round(time.time() - started, 1),
        }
    )
    return result


def child_env(isa: str | None) -> dict:
    env = dict(
        os.environ,
        TF_ENABLE_ONEDNN_OPTS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
    )
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    return env


# ---------------------------------------------------------------------------------------------------
# Sections.


def section_create(args) -> dict:
    from bigmem_train.model.kernel_check import probe_backward_weights

    chunk = plan_depth_chunk(TILE_LAYER)
    cases = [
        ("depth 215 (formula: fits)", ConvGeometry((215, 240, 144), 32, 16)),
        ("depth 216 (formula: over)", ConvGeometry((216, 240, 144), 32, 16)),
        ("tile up0_conv1 240x240x144 32->16", TILE_LAYER),
        ("tile 240x240x144 32->32", ConvGeometry((240, 240, 144), 32, 32)),
        ("tile 240x240x144 16->16 (down0_conv2)", ConvGeometry((240, 240, 144), 16, 16)),
        (f"kit's chunk of up0_conv1 ({chunk} planes + halo)", slab_geometry(TILE_LAYER, chunk)),
    ]
    result = {"rows": []}
    for isa in (args.isa, None):
        load = os.getloadavg()[0]
        created = probe_backward_weights(
            [g for _, g in cases], env={"ONEDNN_MAX_CPU_ISA": isa} if isa else {"ONEDNN_MAX_CPU_ISA": "ALL"}
        )
        for (label, geometry), (implementation, problem) in zip(cases, created):
            row = {
                "isa": isa or "native",
                "case": label,
                "spatial": geometry.spatial,
                "cin": geometry.in_channels,
                "cout": geometry.out_channels,
                "scratchpad_bytes": gemm_backward_weights_scratchpad_bytes(geometry),
                "formula_fits": gemm_backward_weights_fits(geometry),
                "implementation": implementation,
                "problem": problem,
                "load": load,
            }
            result["rows"].append(row)
            log(
                f"{row['isa']:6} {label:45} {row['scratchpad_bytes']:>13,} B  fits={row['formula_fits']!s:5} "
                f"-> {implementation}"
            )
    return result


def section_time(args) -> dict:
    chunk = plan_depth_chunk(TILE_LAYER)
    item = {
        "spatial": list(TILE_LAYER.spatial),
        "cin": 32,
        "cout": 16,
        "kernel": [3, 3, 3],
        "which": ["filter_gradient"],
        "repeats": 2,
    }
    result = {"rows": []}
    for isa in (None, args.isa):
        # Alternate plain and chunked; the plain one past the cliff only under a time limit.
        for variant in ("chunked", "plain"):
            spec = {"ops": [{**item, "chunk": chunk if variant == "chunked" else None}]}
            run = run_worker(spec, child_env(isa), args.ref_timeout)
            row = {
                "isa": isa or "native",
                "variant": variant,
                "chunk": chunk if variant == "chunked" else None,
                **{k: v for k, v in run.items() if k != "rows"},
            }
            if "rows" in run:
                row["filter_gradient"] = run["rows"][0]["filter_gradient"]
            result["rows"].append(row)
            log(json.dumps(row))
    return result


def unet_convolutions(shape, base_filters=16, depth=4):
    """(layer name, input spatial, in channels, out channels) of every 3x3x3 Conv3D of the U-Net."""
    layers = []
    cin = 1
    for level in range(depth):
        spatial = [edge // 2**level for edge in shape]
        filters = base_filters * 2**level
        layers += [
            (f"down{level}_conv1", spatial, cin, filters),
            (f"down{level}_conv2", spatial, filters, filters),
        ]
        cin = filters
    spatial = [edge // 2**depth for edge in shape]
    filters = base_filters * 2**depth
    layers += [("bottom_conv1", spatial, cin, filters), ("bottom_conv2", spatial, filters, filters)]
    for level in reversed(range(depth)):
        spatial = [edge // 2**level for edge in shape]
        filters = base_filters * 2**level
        layers += [
            (f"up{level}_conv1", spatial, 2 * filters, filters),
            (f"up{level}_conv2", spatial, filters, filters),
        ]
    return layers


def section_layers(args) -> dict:
    ops = []
    for name, spatial, cin, cout in unet_convolutions(args.shape):
        geometry = ConvGeometry(tuple(spatial), cin, cout)
        chunk = plan_depth_chunk(geometry)
        which = (
            ["forward", "filter_gradient"]
            if name == "down0_conv1"
            else ["forward", "input_gradient", "filter_gradient"]
        )
        ops.append(
            {
                "name": name,
                "spatial": spatial,
                "cin": cin,
                "cout": cout,
                "kernel": [3, 3, 3],
                "chunk": chunk,
                "which": which,
                "repeats": args.repeats,
                "batch": args.batch,
            }
        )
    run = run_worker({"ops": ops, "threads": args.threads}, child_env(args.layer_isa), args.timeout)
    if "rows" in run:
        total = 0.0
        for row in run["rows"]:
            row["seconds"] = sum(row[op]["best"] for op in row["which"])
            row["gflop"] = (
                2
                * 27
                * row["cin"]
                * row["cout"]
                * row["batch"]
                * (row["spatial"][0] * row["spatial"][1] * row["spatial"][2])
                * len(row["which"])
                / 1e9
            )
            total += row["seconds"]
            log(
                f"{row['name']:14} {row['spatial']} {row['cin']:>3}->{row['cout']:<3} chunk={row['chunk']} "
                + " ".join(f"{op} {row[op]['best']:.3f}s" for op in row["which"])
                + f"  {row['gflop'] / row['seconds']:.1f} GFLOP/s"
            )
        run["sum_seconds"] = total
        log(
            f"sum of the convolutions' best single-op times: {total:.2f} s (load {run['load_before']:.1f}-"
            f"{run['load_after']:.1f})"
        )
    return {
        "shape": args.shape,
        "batch": args.batch,
        "isa": args.layer_isa or "native",
        "threads": args.threads,
        **run,
    }


def plot_layers(report: dict, path: Path) -> None:
    """Per-layer single-op CPU seconds (forward + both gradients) for each measured shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [
        (key, value) for key, value in report.items() if key.startswith("layers-") and "rows" in value
    ]
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 6), squeeze=False)
    for axis, (key, section) in zip(axes[0], sections):
        names = [row["name"] for row in section["rows"]]
        seconds = [sum(row[op]["cpu_best"] for op in row["which"]) for row in section["rows"]]
        axis.barh(
            range(len(names)),
            seconds,
            color=["#c63" if row.get("chunk") else "#3a7" for row in section["rows"]],
        )
        axis.set_yticks(range(len(names)), names)
        axis.invert_yaxis()
        axis.set_xlabel(
            "CPU s: forward + input + filter gradient, best single op\n(orange: chunked filter gradient)"
        )
        axis.set_title(f"{key} (sum {sum(seconds):.1f} CPU-s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sections", nargs="+", default=["create", "time"], choices=["create", "time", "layers", "plot"]
    )
    parser.add_argument("--isa", default="AVX2")
    parser.add_argument("--layer-isa", help="ONEDNN_MAX_CPU_ISA for the layers section (default: native)")
    parser.add_argument("--ref-timeout", type=float, default=300)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--shape", type=int, nargs=3, default=[96, 96, 96])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "onednn_cliff.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.worker[1]).write_text(json.dumps(worker(json.loads(args.worker[0]))))
        return 0
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report["host"] = {
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
        "cores": os.cpu_count(),
    }
    for section in [s for s in args.sections if s != "plot"]:
        log(f"section {section}")
        result = {"create": section_create, "time": section_time, "layers": section_layers}[section](args)
        result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        key = (
            section
            if section != "layers"
            else f"layers-{'x'.join(map(str, args.shape))}-{args.layer_isa or 'native'}"
        )
        if section == "layers" and args.threads:
            key += f"-threads{args.threads}"
        report[key] = result
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    if any(key.startswith("layers-") for key in report):
        plot_layers(report, args.out.with_name(args.out.stem + "-layers.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
