"""Throughput harness: the study's U-Net as a user runs it (reference) vs bigmem-train, and each lever.

Every measurement runs in its own fresh process (environment variables such as LD_PRELOAD and
TF_ENABLE_ONEDNN_OPTS only take effect at process start), alternating reference and bigmem-train
repetition by repetition so that load from other work on the machine hits both alike.

    python benchmarks/throughput.py                       # everything: ~25 min on a loaded 2-core VM
    python benchmarks/throughput.py --sections main       # only reference vs bigmem-train
    python benchmarks/throughput.py --sections levers --levers recompute mixed_bfloat16

Writes ``benchmarks/results/throughput.json`` and ``throughput.png`` (``--out``). Per run: median
wall-clock step time (after warm-up steps, which include tracing), voxels per second, process CPU
seconds per step (less sensitive to other load than wall time), peak resident memory (VmHWM) and the
share of resident memory in transparent huge pages (AnonHugePages, sampled during training).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
ALLOCATORS = {
    "glibc": None,
    "jemalloc": LIBDIR / "libjemalloc.so.2",
    "tcmalloc": LIBDIR / "libtcmalloc_minimal.so.4",
}


def chosen_settings() -> dict:
    """bigmem-train's chosen settings: the config schema's defaults (one source of truth); each lever
    below changes exactly one of them."""
    sys.path.insert(0, str(REPO / "src"))
    from bigmem_train.config import Config

    config = Config()
    return {
        "onednn": config.runtime.onednn,
        "allocator": config.runtime.allocator,
        "tensor_allocator": config.runtime.tensor_allocator,
        "thp": False,
        "intra": config.runtime.intra_op_threads,  # None: launch.choose_threads (physical cores)
        "inter": config.runtime.inter_op_threads,  # None: launch.choose_threads (1)
        "pin": False,
        "precision": config.runtime.precision,
        "recompute": config.model.recompute,
        "fold_upsampling": config.model.fold_upsampling,
    }


CHOSEN = chosen_settings()

LEVERS = {
    "threads: TF defaults (intra=inter=cores)": {"intra": 0, "inter": 0},
    "threads: intra 1, inter 1": {"intra": 1, "inter": 1},
    # One thread in all, as the kit runs a single host (ops inline in the calling thread): 1 vs 2 threads.
    "threads: intra 1, ops inline": {"intra": 1, "inter": None},
    "pinning: numactl --physcpubind=all --membind=0": {"pin": True},
    "allocator: glibc": {"allocator": "glibc"},
    "allocator: jemalloc": {"allocator": "jemalloc"},
    "THP: glibc malloc hugetlb=1": {"allocator": "glibc", "thp": True},
    "THP: jemalloc thp:always": {"allocator": "jemalloc", "thp": True},
    "oneDNN off (Eigen)": {"onednn": False},
    "mixed_bfloat16": {"precision": "mixed_bfloat16"},
    "recompute": {"recompute": True},
    # The planner's third lever: both of the above together.
    "recompute + mixed_bfloat16": {"recompute": True, "precision": "mixed_bfloat16"},
    # The kit folds the two shallowest decoder levels' transposed convolution, concatenation and first
    # convolution into one transposed convolution (upconv.py, same mathematics; AVX-512 CPUs); this is the
    # unfolded arrangement, as a plain Keras script has it.
    "upsampling unfolded (model.fold_upsampling: false)": {"fold_upsampling": False},
    # oneDNN lets float32 convolutions compute in bfloat16 (AMX / AVX512_BF16) when this is set; on CPUs
    # without them it changes nothing. Numerics change (like TF32 on GPUs): opt-in, measured on its own.
    "oneDNN fpmath bf16 (ONEDNN_DEFAULT_FPMATH_MODE=BF16)": {"env": {"ONEDNN_DEFAULT_FPMATH_MODE": "BF16"}},
    "tensor allocator: TensorFlow's BFC pool": {"tensor_allocator": "bfc"},
    # The kit builds batch normalization on TensorFlow's fused kernel (norm.py); this is Keras' own layer.
    "batch norm: Keras' unfused layer": {"env": {"BIGMEM_BATCH_NORM": "keras"}},
}


# ---------------------------------------------------------------------------------------------------
# Worker side (one process per measurement).


class PeakSampler:
    """RSS and AnonHugePages of this process every ``interval`` s; keeps the sample with the largest RSS."""

    def __init__(self, interval: float = 0.5):  # reads smaps_rollup (a page-table walk): not too often
        self.interval = interval
        self.peak_rss = 0
        self.huge_at_peak = 0
        self.max_huge = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def read() -> tuple[int, int]:
        text = Path("/proc/self/smaps_rollup").read_text()
        values = {}
        for line in text.splitlines()[1:]:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024
        return values.get("Rss", 0), values.get("AnonHugePages", 0)

    def _loop(self):
        while not self._stop.is_set():
            rss, huge = self.read()
            self.max_huge = max(self.max_huge, huge)
            if rss > self.peak_rss:
                self.peak_rss, self.huge_at_peak = rss, huge
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _step_callback(keras, record):
    class StepClock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not record:
                record.append((time.perf_counter(), time.process_time()))

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # wait for the step's result
            record.append((time.perf_counter(), time.process_time()))

    return StepClock()


def _durations(record, warmup):
    walls = [b[0] - a[0] for a, b in zip(record, record[1:])]
    cpus = [b[1] - a[1] for a, b in zip(record, record[1:])]
    return walls[warmup:], cpus[warmup:], walls[:warmup]


def analytic_training_flops(input_shape, channels, base_filters, depth, batch) -> int:
    """Convolution FLOPs of one training step (2 per multiply-add), counted from the reference's layers.

    Forward, input gradient and filter gradient each cost the forward FLOPs of a convolution; the first
    convolution needs no input gradient. Batch norm, ReLU, pooling and the loss are left out (< 1 %).
    """
    import math

    from reference_unet import unet3d

    model = unet3d(input_shape, channels, base_filters, depth)
    total, first = 0, None
    for layer in model.layers:
        kind = type(layer).__name__
        if kind not in ("Conv3D", "Conv3DTranspose"):
            continue
        kernel = math.prod(layer.kernel_size)
        cin = layer.input.shape[-1]
        cout = layer.filters
        voxels = math.prod(layer.output.shape[1:4] if kind == "Conv3D" else layer.input.shape[1:4])
        forward = 2 * kernel * cin * cout * voxels * batch
        if first is None:
            first = forward
        total += 3 * forward
    return total - first


def worker_model(spec: dict) -> dict:
    """Train ``warmup + steps`` steps of the reference or of bigmem-train; return the figures."""
    sys.path.insert(0, str(HERE))
    shape = tuple(spec["shape"])
    batch, warmup, steps = spec["batch"], spec["warmup"], spec["steps"]
    baseline_rss = PeakSampler.read()[0]
    import tensorflow as tf

    from bigmem_train.train.monitor import peak_rss_bytes

    after_import_rss = PeakSampler.read()[0]
    from tensorflow import keras

    record: list = []
    result: dict = {}
    interval = spec.get("sample_interval", 0.5)

    def fit_starts():  # for a bound on the first step when the parent has to stop a run past a cliff
        if spec.get("progress"):
            Path(spec["progress"]).write_text(json.dumps({"fit_started": time.time()}))

    if spec["kind"] == "reference":
        import reference_unet

        index = json.loads((Path(spec["dataset"]) / "dataset.json").read_text())["training"]
        cases = index[: batch * (warmup + steps)]
        x, y = reference_unet.load_arrays(
            [Path(spec["dataset"]) / c["image"] for c in cases],
            [Path(spec["dataset"]) / c["label"] for c in cases],
            shape,
        )
        model = reference_unet.unet3d(shape, 1, spec["base_filters"], spec["depth"])
        model.compile(optimizer="adam", loss=reference_unet.dice_bce_loss, metrics=[reference_unet.dice_coef])
        fit_starts()
        with PeakSampler(interval) as sampler:
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[_step_callback(keras, record)])
        result["threads"] = [
            tf.config.threading.get_intra_op_parallelism_threads(),
            tf.config.threading.get_inter_op_parallelism_threads(),
        ]
    else:
        from bigmem_train.config import config_from_dict
        from bigmem_train.data.pipeline import make_datasets
        from bigmem_train.data.reader import check_dataset
        from bigmem_train.data.split import split_cases
        from bigmem_train.host import read_host_facts
        from bigmem_train.model.unet import compile_model
        from bigmem_train.train.launch import choose_threads

        settings = spec["settings"]
        runtime = {
            "precision": settings["precision"],
            "allocator": settings["allocator"],
            "tensor_allocator": settings.get("tensor_allocator", "bfc"),
        }
        if settings["intra"]:
            runtime["intra_op_threads"] = settings["intra"]
        if settings["inter"]:
            runtime["inter_op_threads"] = settings["inter"]
        config = config_from_dict(
            {
                "data": {
                    "source": "decathlon",
                    "path": spec["dataset"],
                    "input_shape": list(shape),
                    "crop_jitter": 0,
                },
                "model": {
                    "depth": spec["depth"],
                    "base_filters": spec["base_filters"],
                    "recompute": settings["recompute"],
                    "fold_upsampling": settings.get("fold_upsampling", False),
                },
                "training": {"batch_size": batch, "steps_per_epoch": warmup + steps},
                "runtime": runtime,
            }
        )
        if settings["intra"] == 0:  # 0 = leave TensorFlow's own defaults
            threads = None
        else:
            threads = choose_threads(config, read_host_facts())
            tf.config.threading.set_intra_op_parallelism_threads(threads[0])
            tf.config.threading.set_inter_op_parallelism_threads(threads[1])
        cases = check_dataset(config)
        train_cases, validation_cases = split_cases(
            cases, config.data.validation_fraction, config.data.split_seed
        )
        datasets = make_datasets(config, train_cases, validation_cases)
        # The input pipeline on its own: seconds per batch, to compare with the step time.
        iterator = iter(datasets.train)
        next(iterator)
        started = time.perf_counter()
        for _ in range(3):
            next(iterator)
        result["pipeline_seconds_per_batch"] = (time.perf_counter() - started) / 3
        model = compile_model(config)
        fit_starts()
        with PeakSampler(interval) as sampler:
            model.fit(
                datasets.train,
                steps_per_epoch=warmup + steps,
                epochs=1,
                verbose=0,
                callbacks=[_step_callback(keras, record)],
            )
        result["threads"] = list(threads) if threads else [0, 0]
    walls, cpus, warm = _durations(record, warmup)
    median = statistics.median(walls)
    result.update(
        {
            "step_seconds": walls,
            "median_step_seconds": median,
            "cpu_seconds_per_step": statistics.median(cpus),
            "warmup_seconds": warm,
            "voxels_per_second": batch * shape[0] * shape[1] * shape[2] / median,
            "peak_rss_bytes": peak_rss_bytes(),  # VmHWM: this process's own, not its parent's
            "rss_before_import_bytes": baseline_rss,
            "rss_after_import_bytes": after_import_rss,
            "sampled_peak_rss_bytes": sampler.peak_rss,
            "anon_hugepages_at_peak_bytes": sampler.huge_at_peak,
            "thp_share_at_peak": sampler.huge_at_peak / sampler.peak_rss if sampler.peak_rss else 0.0,
            "onednn_env": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "tensorflow": tf.__version__,
        }
    )
    return result


def worker_conv(spec: dict) -> dict:
    """Best FLOP/s of one large 3x3x3 Conv3D forward + both gradients, over a few shapes."""
    import tensorflow as tf

    if spec.get("intra"):
        tf.config.threading.set_intra_op_parallelism_threads(spec["intra"])
        tf.config.threading.set_inter_op_parallelism_threads(1)
    rows = []
    for batch, x, y, z, cin, cout in spec["shapes"]:
        data = tf.random.normal((batch, x, y, z, cin))
        kernel = tf.Variable(tf.random.normal((3, 3, 3, cin, cout)) * 0.05)

        # Traced and called within this iteration: the closure's data and kernel are this shape's.
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(data)  # noqa: B023
                out = tf.nn.conv3d(data, kernel, [1] * 5, "SAME")  # noqa: B023
                loss = tf.reduce_sum(out * out)
            return tape.gradient(loss, [data, kernel])  # noqa: B023

        step()
        times, cpu_times = [], []
        for _ in range(spec["repeats"]):
            started, cpu_started = time.perf_counter(), time.process_time()
            grads = step()
            grads[0].numpy()
            times.append(time.perf_counter() - started)
            cpu_times.append(time.process_time() - cpu_started)
        flops = 3 * 2 * 27 * cin * cout * batch * x * y * z
        rows.append(
            {
                "shape": [batch, x, y, z, cin, cout],
                "best_seconds": min(times),
                "median_seconds": statistics.median(times),
                "gflops_best": flops / min(times) / 1e9,
                "gflops_median": flops / statistics.median(times) / 1e9,
                "gflop_per_cpu_second": flops / min(cpu_times) / 1e9,
            }
        )
    return {
        "convolutions": rows,
        "best_gflops": max(row["gflops_best"] for row in rows),
        "best_gflop_per_cpu_second": max(row["gflop_per_cpu_second"] for row in rows),
        "onednn_env": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
    }


# ---------------------------------------------------------------------------------------------------
# Orchestrator.


# Reference rows: the same plain Keras script, as a user runs it on stock TensorFlow, and with oneDNN
# switched on the way a user who read the study would (the informed peer).
REFERENCE_ROWS = {"stock": {}, "peer": {"TF_ENABLE_ONEDNN_OPTS": "1"}}
ROW_LABELS = {
    "stock": "plain Keras, stock TF",
    "peer": "plain Keras + TF_ENABLE_ONEDNN_OPTS=1 (the peer)",
    "bigmem": "bigmem-train, chosen settings",
}
LOADED = 1.5  # a ratio taken above this 1-min load average (2 cores) is flagged


def environment_for(kind: str, settings: dict | None, extra: dict | None = None) -> tuple[dict, list[str]]:
    """The child's environment and command prefix: the reference gets the inherited one untouched
    (``extra``: the peer's TF_ENABLE_ONEDNN_OPTS=1; ONEDNN_MAX_CPU_ISA for every row under --isa)."""
    env, prefix = _environment(kind, settings)
    env.update(extra or {})
    env.update((settings or {}).get("env", {}))
    return env, prefix


def _environment(kind: str, settings: dict | None) -> tuple[dict, list[str]]:
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    for key in (
        "LD_PRELOAD",
        "TF_ENABLE_ONEDNN_OPTS",
        "TF_ONEDNN_USE_SYSTEM_ALLOCATOR",
        "GLIBC_TUNABLES",
        "MALLOC_CONF",
    ):
        env.pop(key, None)
    prefix: list[str] = []
    if settings is None:
        return env, prefix
    env["TF_ENABLE_ONEDNN_OPTS"] = "1" if settings["onednn"] else "0"
    env["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = "1" if settings.get("tensor_allocator") == "system" else "0"
    library = ALLOCATORS[settings["allocator"]]
    if library is not None:
        env["LD_PRELOAD"] = str(library)
    if settings["thp"]:
        if settings["allocator"] == "glibc":
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        elif settings["allocator"] == "jemalloc":
            env["MALLOC_CONF"] = "thp:always,metadata_thp:auto"
    if settings["pin"] and shutil.which("numactl"):
        prefix = ["numactl", "--physcpubind=all", "--membind=0"]
    return env, prefix


def run_child(spec: dict, settings: dict | None, timeout: float, extra_env: dict | None = None) -> dict:
    env, prefix = environment_for(spec.get("kind", "conv"), settings, extra_env)
    load_before = os.getloadavg()[0]
    with (
        tempfile.NamedTemporaryFile("r", suffix=".json") as out,
        tempfile.NamedTemporaryFile("r", suffix=".progress") as progress,
    ):
        spec = {**spec, "progress": progress.name}
        command = [
            *prefix,
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            json.dumps(spec),
            out.name,
        ]
        started = time.time()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            ended = time.time()
            failed = {
                "error": f"timed out after {timeout:.0f} s",
                "process_seconds": ended - started,
                "load_before": load_before,
                "load_average": os.getloadavg()[0],
            }
            failed["loaded"] = max(load_before, failed["load_average"]) > LOADED
            try:  # the steps had run this long without finishing: a lower bound on the first one
                failed["first_step_over_seconds"] = round(
                    ended - json.loads(progress.read())["fit_started"], 1
                )
            except ValueError:
                pass
            return failed
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-2000:]
            return {
                "error": f"exit {proc.returncode}: {tail}",
                "process_seconds": time.time() - started,
                "load_before": load_before,
                "load_average": os.getloadavg()[0],
            }
        result = json.loads(Path(out.name).read_text())
    result["process_seconds"] = round(time.time() - started, 1)
    result["load_before"] = load_before
    result["load_average"] = os.getloadavg()[0]
    result["loaded"] = max(load_before, result["load_average"]) > LOADED
    return result


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict]) -> dict:
    ok = [run for run in runs if "error" not in run]
    return {
        "median_step_seconds": spread([run["median_step_seconds"] for run in ok]),
        "voxels_per_second": spread([run["voxels_per_second"] for run in ok]),
        "cpu_seconds_per_step": spread([run["cpu_seconds_per_step"] for run in ok]),
        "peak_rss_bytes": spread([run["peak_rss_bytes"] for run in ok]),
        "activation_peak_bytes": spread(
            [run["peak_rss_bytes"] - run["rss_after_import_bytes"] for run in ok]
        ),
        "thp_share_at_peak": spread([run["thp_share_at_peak"] for run in ok]),
        "pipeline_seconds_per_batch": spread([run.get("pipeline_seconds_per_batch") for run in ok]),
        "load_average": spread([max(run.get("load_before", 0), run.get("load_average", 0)) for run in runs]),
        "first_step_over_seconds": spread([run.get("first_step_over_seconds") for run in runs]),
        "errors": [run["error"] for run in runs if "error" in run],
    }


def ratios(b_runs: list[dict], a_runs: list[dict]) -> dict:
    """b/a per repetition pair (runs are interleaved), and their spread."""
    pairs = [(b, a) for b, a in zip(b_runs, a_runs) if "error" not in b and "error" not in a]
    bounds = [
        b["voxels_per_second"] * a["first_step_over_seconds"] / (b_steps(b))
        for b, a in zip(b_runs, a_runs)
        if "error" not in b and a.get("first_step_over_seconds")
    ]
    return {
        "pairs": len(pairs),
        "loaded_pairs": sum(1 for b, a in pairs if b.get("loaded") or a.get("loaded")),
        # a's run did not finish its first step: b's voxels/s over a's is at least this
        "voxels_per_second_at_least": spread(bounds),
        "bound_loaded": any(
            b.get("loaded") or a.get("loaded")
            for b, a in zip(b_runs, a_runs)
            if a.get("first_step_over_seconds")
        ),
        "voxels_per_second": spread([b["voxels_per_second"] / a["voxels_per_second"] for b, a in pairs]),
        "median_step_seconds": spread(
            [b["median_step_seconds"] / a["median_step_seconds"] for b, a in pairs]
        ),
        "cpu_seconds_per_step": spread(
            [b["cpu_seconds_per_step"] / a["cpu_seconds_per_step"] for b, a in pairs]
        ),
        "peak_rss_bytes": spread([b["peak_rss_bytes"] / a["peak_rss_bytes"] for b, a in pairs]),
    }


def b_steps(run: dict) -> float:
    """Voxels of one step of ``run``: its voxels/s times its median step."""
    return run["voxels_per_second"] * run["median_step_seconds"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def describe(run: dict) -> str:
    if "error" in run:
        return "ERROR " + run["error"].splitlines()[-1][:200]
    return (
        f"step {run['median_step_seconds']:.2f} s, {run['voxels_per_second'] / 1e3:.1f} kvox/s, "
        f"cpu {run['cpu_seconds_per_step']:.2f} s/step, peak {run['peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"THP {100 * run['thp_share_at_peak']:.0f} %, load {run['load_average']:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[64, 64, 48])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--base-filters", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (tracing, first allocations)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument(
        "--reps", type=int, default=3, help="alternating repetitions of reference and bigmem-train"
    )
    parser.add_argument("--lever-reps", type=int, default=1)
    parser.add_argument(
        "--skip-baseline",
        action="store_true",
        help="levers: keep the chosen-settings run from the JSON instead of running it again",
    )
    parser.add_argument("--lever-warmup", type=int, default=1)
    parser.add_argument("--lever-steps", type=int, default=2)
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["main", "levers"],
        choices=["limit", "main", "levers", "report"],
        help="report: only rebuild the table and plot from the JSON",
    )
    parser.add_argument("--levers", nargs="*", help="only these levers (names as in the table)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--rows", nargs="+", default=["stock", "peer", "bigmem"], choices=["stock", "peer", "bigmem"]
    )
    parser.add_argument(
        "--isa", help="ONEDNN_MAX_CPU_ISA for every run (AVX2: oneDNN as on an AVX2-only CPU)"
    )
    parser.add_argument(
        "--peer-timeout", type=float, help="time limit of a reference run (a bound past a cliff)"
    )
    parser.add_argument("--cases", type=int, help="synthetic cases to write (default: enough for the steps)")
    parser.add_argument("--sample-interval", type=float, default=0.5, help="peak-RSS sampler period, s")
    parser.add_argument(
        "--limit-per-rep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the single-Conv3D limit in each repetition",
    )
    parser.add_argument(
        "--name", default="throughput", help="results file stem (throughput -> throughput.json)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(args.worker[0])
        result = worker_conv(spec) if spec.get("kind") == "conv" else worker_model(spec)
        Path(args.worker[1]).write_text(json.dumps(result))
        return 0

    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(HERE))
    from bigmem_train.data.synth import write_synthetic_dataset

    args.out.mkdir(parents=True, exist_ok=True)
    most_steps = max(args.warmup + args.steps, args.lever_warmup + args.lever_steps)
    dataset = args.out / ("dataset-" + "x".join(map(str, args.shape)))
    if set(args.sections) - {"report"}:
        dataset = write_synthetic_dataset(
            dataset, cases=args.cases or max(16, args.batch * most_steps + 4), shape=tuple(args.shape), seed=7
        )
    common = {
        "shape": args.shape,
        "batch": args.batch,
        "base_filters": args.base_filters,
        "depth": args.depth,
        "warmup": args.warmup,
        "steps": args.steps,
        "dataset": str(dataset),
        "sample_interval": args.sample_interval,
    }
    isa_env = {"ONEDNN_MAX_CPU_ISA": args.isa} if args.isa else {}
    results_path = args.out / f"{args.name}.json"
    report: dict = json.loads(results_path.read_text()) if results_path.exists() else {}
    report.update(
        {
            "command": "python benchmarks/throughput.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {
                "cpu": _cpu_model(),
                "cores": os.cpu_count(),
                "flags": _flags_of_interest(),
                "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
            },
            "workload": {key: common[key] for key in ("shape", "batch", "base_filters", "depth")},
            "onednn_max_cpu_isa": args.isa,
            "load_at_start": os.getloadavg(),
            "chosen_settings": CHOSEN,
        }
    )
    conv_spec = {
        "kind": "conv",
        "repeats": 3,
        "shapes": [[2, 32, 32, 24, 64, 64], [1, 64, 64, 64, 32, 32], [2, 64, 64, 48, 16, 16]],
    }
    if "limit" in args.sections:
        limit_runs = {}
        for label, settings in (("stock", None), ("chosen", CHOSEN)):
            log(f"limit: single Conv3D forward+backward ({label} settings)")
            run = run_child(conv_spec, settings, args.timeout)
            limit_runs[label] = run
            log(json.dumps({k: v for k, v in run.items() if k != "convolutions"}))
        report["limit_settings"] = limit_runs

    if "main" in args.sections:
        rows = args.rows
        runs: dict = {name: [] for name in rows}
        for rep in range(args.reps):
            # Alternating order (rotated each repetition) so that load from other work hits every row alike.
            order = rows[rep % len(rows) :] + rows[: rep % len(rows)]
            for name in order:
                if name == "bigmem":
                    spec = {**common, "kind": "bigmem", "settings": CHOSEN}
                    run = run_child(spec, CHOSEN, args.timeout, isa_env)
                else:
                    spec = {**common, "kind": "reference"}
                    timeout = args.peer_timeout or args.timeout
                    run = run_child(spec, None, timeout, {**REFERENCE_ROWS[name], **isa_env})
                runs[name].append(run)
                log(f"rep {rep + 1} {name}: {describe(run)}")
                save_main(report, runs, args, results_path)
            if args.limit_per_rep:
                # The limit in the same repetition, under the same load: one Conv3D forward + backward.
                run = run_child(conv_spec, CHOSEN, args.timeout, isa_env)
                runs.setdefault("conv", []).append(run)
                log(
                    f"rep {rep + 1} conv limit: "
                    + json.dumps({k: v for k, v in run.items() if k != "convolutions"})
                )
        save_main(report, runs, args, results_path)

    if "levers" in args.sections:
        levers = dict(report.get("levers", {}))
        names = args.levers or list(LEVERS)
        for rep in range(args.lever_reps):
            for name in names if args.skip_baseline else ["bigmem-train (chosen)", *names]:
                settings = {**CHOSEN, **LEVERS.get(name, {})}
                spec = {
                    **common,
                    "kind": "bigmem",
                    "settings": settings,
                    "warmup": args.lever_warmup,
                    "steps": args.lever_steps,
                }
                run = run_child(spec, settings, args.timeout)
                entry = levers.setdefault(name, {"settings": settings, "runs": []})
                if rep == 0 and entry.get("started") != report["started"]:
                    entry.update(
                        {
                            "runs": [],
                            "started": report["started"],
                            "settings": settings,
                            "warmup": args.lever_warmup,
                            "steps": args.lever_steps,
                        }
                    )
                entry["runs"].append(run)
                log(f"lever {name}: {describe(run)}")
                entry["summary"] = summarize(entry["runs"])
                report["levers"] = levers
                report["levers_workload"] = {
                    **report["workload"],
                    "warmup": args.lever_warmup,
                    "steps": args.lever_steps,
                }
                save(report, args, results_path)  # a partial run still leaves its numbers
        for entry in levers.values():
            entry["summary"] = summarize(entry["runs"])
        report["levers"] = levers
        report["levers_workload"] = {
            **report["workload"],
            "warmup": args.lever_warmup,
            "steps": args.lever_steps,
        }

    save(report, args, results_path)
    _print_table(report)
    try:
        _plot(report, args.out / f"{args.name}.png")
    except Exception as error:  # the numbers matter more than the picture
        log(f"plot failed: {error}")
    return 0


def save_main(report: dict, runs: dict, args, results_path: Path) -> None:
    """The main section: every row's runs and summary, and the ratios per repetition (headline: bigmem-train
    over the peer), flagged when a run of the pair saw a load above LOADED."""
    section = {
        "runs": runs,
        "warmup": args.warmup,
        "steps": args.steps,
        "workload": report["workload"],
        "rows": args.rows,
        "ratios": {},
    }
    for name in args.rows:
        section[name] = summarize(runs.get(name, []))
    for b, a in (("bigmem", "peer"), ("bigmem", "stock"), ("peer", "stock")):
        if b in runs and a in runs:
            section["ratios"][f"{b}/{a}"] = ratios(runs[b], runs[a])
    report["main"] = section
    save(report, args, results_path)


def save(report: dict, args, results_path: Path) -> None:
    """Write the JSON; sections another invocation wrote meanwhile (other --sections) are kept."""
    report.setdefault("commands", {}).update(dict.fromkeys(args.sections, report["command"]))
    latest = json.loads(results_path.read_text()) if results_path.exists() else {}
    for section in ("main", "levers", "levers_workload", "limit_settings"):
        mine = section.split("_")[0] in args.sections
        if section in latest and not mine:
            report[section] = latest[section]
    report["commands"] = {**latest.get("commands", {}), **report["commands"]}
    _add_flops(report, args)
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results_path.write_text(json.dumps(report, indent=1))


def _add_flops(report: dict, args) -> None:
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

    def flops_of(workload):
        return analytic_training_flops(
            tuple(workload["shape"]), 1, workload["base_filters"], workload["depth"], workload["batch"]
        )

    fallback = {
        "shape": args.shape,
        "batch": args.batch,
        "base_filters": args.base_filters,
        "depth": args.depth,
    }
    flops = flops_of(report.get("main", {}).get("workload", fallback))
    report["training_flops_per_step"] = flops
    main_section = report.get("main")
    if main_section:
        runs = main_section["runs"]
        for name in main_section.get("rows", []):
            summary = main_section[name]
            per_rep = []
            for run, conv in zip(runs[name], runs.get("conv", [])):
                if "error" in run or "error" in conv:
                    continue
                achieved = flops / run["median_step_seconds"] / 1e9
                achieved_cpu = flops / run["cpu_seconds_per_step"] / 1e9
                per_rep.append(
                    (
                        achieved,
                        achieved / conv["best_gflops"],
                        achieved_cpu / conv["best_gflop_per_cpu_second"],
                    )
                )
            summary["achieved_gflops"] = spread([row[0] for row in per_rep])
            summary["share_of_limit"] = spread([row[1] for row in per_rep])
            summary["share_of_limit_cpu_time"] = spread([row[2] for row in per_rep])
        conv_ok = [conv for conv in runs.get("conv", []) if "error" not in conv]
        report["limit"] = {
            "best_gflops": spread([conv["best_gflops"] for conv in conv_ok]),
            "best_gflop_per_cpu_second": spread([conv["best_gflop_per_cpu_second"] for conv in conv_ok]),
            "shapes": conv_spec_shapes(),
        }
    lever_flops = flops_of(report.get("levers_workload", fallback))
    for entry in report.get("levers", {}).values():
        step = entry["summary"]["median_step_seconds"]
        if step:
            entry["summary"]["achieved_gflops"] = lever_flops / step["median"] / 1e9
            entry["summary"]["gflop_per_cpu_second"] = (
                lever_flops / entry["summary"]["cpu_seconds_per_step"]["median"] / 1e9
            )


def conv_spec_shapes() -> str:
    return "batch, X, Y, Z, in, out channels; best of these: [2,32,32,24,64,64], [1,64,64,64,32,32], [2,64,64,48,16,16]"


def _fmt(summary: dict, scale: float = 1.0, digits: int = 2) -> str:
    if not summary:
        return "-"
    text = f"{summary['median'] * scale:.{digits}f}"
    if summary["n"] > 1:
        text += f" ({summary['min'] * scale:.{digits}f}-{summary['max'] * scale:.{digits}f})"
    return text


def markdown_tables(report: dict) -> str:
    """The tables of docs/design/performance.md: median (min-max) over repetitions."""
    lines = []
    main_section = report.get("main")
    if main_section:
        lines += [
            "| run | median step, s | kvoxels/s | CPU s/step | peak RSS, MiB | load (1 min) | GFLOP/s "
            "| share of conv limit (wall / CPU time) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in main_section.get("rows", []):
            s = main_section[name]
            if not s["median_step_seconds"]:
                bound = s.get("first_step_over_seconds") or {}
                lines.append(
                    f"| {ROW_LABELS[name]} | > {_fmt(bound, 1, 0)} (first step unfinished) | | | | "
                    f"{_fmt(s['load_average'], 1, 1)} | | |"
                )
                continue
            lines.append(
                f"| {ROW_LABELS[name]} | {_fmt(s['median_step_seconds'])} | {_fmt(s['voxels_per_second'], 1e-3, 1)} "
                f"| {_fmt(s['cpu_seconds_per_step'])} | {_fmt(s['peak_rss_bytes'], 2**-20, 0)} "
                f"| {_fmt(s['load_average'], 1, 1)} "
                f"| {_fmt(s.get('achieved_gflops', {}), 1, 1)} | {_fmt(s.get('share_of_limit', {}), 100, 0)} % / "
                f"{_fmt(s.get('share_of_limit_cpu_time', {}), 100, 0)} % |"
            )
        lines += [
            "",
            "| ratio (per repetition pair) | voxels/s | step time | CPU s/step | peak RSS | pairs (loaded > "
            f"{LOADED}) |",
            "|---|---|---|---|---|---|",
        ]
        for key, r in main_section["ratios"].items():
            voxels = _fmt(r["voxels_per_second"])
            if r.get("voxels_per_second_at_least"):
                bound = _fmt(r["voxels_per_second_at_least"], 1, 1)
                voxels = f">= {bound} (bound: the other run's first step unfinished)"
            lines.append(
                f"| {key} | {voxels} | {_fmt(r['median_step_seconds'])} | {_fmt(r['cpu_seconds_per_step'])} "
                f"| {_fmt(r['peak_rss_bytes'])} | {r['pairs']} ({r['loaded_pairs']} loaded) |"
            )
        limit = report.get("limit", {})
        if limit.get("best_gflops"):
            lines.append("")
            lines.append(
                f"Conv limit (single 3x3x3 Conv3D forward + input and filter gradients, best shape, "
                f"measured in each repetition): {_fmt(limit['best_gflops'], 1, 1)} GFLOP/s wall, "
                f"{_fmt(limit['best_gflop_per_cpu_second'], 1, 1)} GFLOP per CPU-second. "
                f"Training step: {report['training_flops_per_step'] / 1e9:.1f} GFLOP (analytic, convolutions)."
            )
    levers = report.get("levers")
    if levers:
        base = levers.get("bigmem-train (chosen)", {}).get("summary", {})
        lines += [
            "",
            "| lever (one change from the chosen settings) | median step, s | CPU s/step | CPU vs chosen "
            "| peak RSS, MiB | peak vs chosen | THP share | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, entry in levers.items():
            s = entry["summary"]
            if not s["median_step_seconds"]:
                lines.append(f"| {name} | - | - | - | - | - | - | {'; '.join(s['errors'])[:80]} |")
                continue
            cpu_ratio = (
                s["cpu_seconds_per_step"]["median"] / base["cpu_seconds_per_step"]["median"]
                if base.get("cpu_seconds_per_step")
                else None
            )
            peak_ratio = (
                s["peak_rss_bytes"]["median"] / base["peak_rss_bytes"]["median"]
                if base.get("peak_rss_bytes")
                else None
            )
            pipeline = s.get("pipeline_seconds_per_batch") or {}
            note = f"input pipeline {pipeline['median']:.2f} s/batch" if pipeline else ""
            lines.append(
                f"| {name} | {_fmt(s['median_step_seconds'])} | {_fmt(s['cpu_seconds_per_step'])} | "
                f"{f'{cpu_ratio:.2f}x' if cpu_ratio else '-'} | {_fmt(s['peak_rss_bytes'], 2**-20, 0)} | "
                f"{f'{peak_ratio:.2f}x' if peak_ratio else '-'} | {_fmt(s['thp_share_at_peak'], 100, 0)} % | {note} |"
            )
    return "\n".join(lines)


def _print_table(report: dict) -> None:
    print(markdown_tables(report))
    main_section = report.get("main")
    if main_section:
        print("ratios:", json.dumps(main_section["ratios"]))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, steps, lows, highs, peaks = [], [], [], [], []
    main_section = report.get("main", {})
    for name in main_section.get("rows", []):
        label = ROW_LABELS[name]
        if main_section[name]["median_step_seconds"]:
            s = main_section[name]
            names.append(label)
            steps.append(s["cpu_seconds_per_step"]["median"])
            lows.append(s["cpu_seconds_per_step"]["min"])
            highs.append(s["cpu_seconds_per_step"]["max"])
            peaks.append(s["peak_rss_bytes"]["median"] / 2**20)
    for name, entry in report.get("levers", {}).items():
        s = entry["summary"]
        if s["median_step_seconds"] and name != "bigmem-train (chosen)":
            names.append("lever: " + name)
            steps.append(s["cpu_seconds_per_step"]["median"])
            lows.append(s["cpu_seconds_per_step"]["min"])
            highs.append(s["cpu_seconds_per_step"]["max"])
            peaks.append(s["peak_rss_bytes"]["median"] / 2**20)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.8), sharey=True)
    positions = range(len(names))
    errors = [[s - lo for s, lo in zip(steps, lows)], [hi - s for s, hi in zip(steps, highs)]]
    left.barh(positions, steps, xerr=errors, color=["#3a7" if "bigmem" in name else "#999" for name in names])
    left.set_yticks(list(positions), names)
    left.invert_yaxis()
    left.set_xlabel(
        "process CPU seconds per training step (bars: min-max over repetitions)\n"
        "wall-clock times and load: see the table"
    )
    right.barh(positions, peaks, color="#58c")
    right.set_xlabel("peak resident memory, MiB")
    workload = report["workload"]
    isa = f", ONEDNN_MAX_CPU_ISA={report['onednn_max_cpu_isa']}" if report.get("onednn_max_cpu_isa") else ""
    fig.suptitle(
        f"3D U-Net {workload['shape']} x batch {workload['batch']}, {workload['base_filters']} filters, "
        f"depth {workload['depth']} on {report['host']['cpu']} ({report['host']['cores']} cores{isa})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _flags_of_interest() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(
                flags & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}
            )
    return []


if __name__ == "__main__":
    sys.exit(main())
