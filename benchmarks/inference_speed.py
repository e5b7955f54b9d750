"""Inference speed and memory: the kit's whole `bigmem-train predict` of one case against the peer a user
would write, plain Keras ``model.predict`` on the padded volume (oneDNN on in both).

The study's whole volume: 240x240x155 with the Decathlon's 4 channels on disk, FLAIR read, padded to
240x240x160, the study's U-Net (4 poolings, 16 filters, batch 1) with untrained weights (speed and memory
do not depend on them). Every measurement is a fresh process; kit and peer alternate, ``--repeats`` each;
the load average is recorded before each. The kit's time is its whole case (read, normalize, infer,
write) from predict.json; the peer's is the ``model.predict`` call alone (its read and padding are not
counted). Peak memory is each process's peak resident set.

    python benchmarks/inference_speed.py --repeats 3     # ~4 min on 2 cores

Writes benchmarks/results/inference_speed.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "inference_speed.json"
SHAPE = (240, 240, 155)
PADDED = (240, 240, 160)

SETUP = """
import pathlib, numpy as np, nibabel as nib, yaml
from bigmem_train.config import load_config
from bigmem_train.model.unet import build_unet
folder = pathlib.Path({folder!r})
job = {{"data": {{"channels": [0]}}, "model": {{"depth": 4, "base_filters": 16}}}}
(folder / "config.yaml").write_text(yaml.safe_dump(job))
config = load_config(folder / "config.yaml")
(folder / "checkpoints").mkdir()
build_unet(config.model, (32, 32, 32), 1).save(folder / "checkpoints" / "best.keras")
rng = np.random.default_rng(0)
data = rng.integers(0, 1000, size=({shape}, 4), dtype=np.int16)
data[:20], data[-20:] = 0, 0
nib.save(nib.Nifti1Image(data, np.eye(4)), folder / "case.nii.gz")
"""

PEER = """
import json, resource, time, numpy as np, nibabel as nib, keras
import bigmem_train.model.unet  # the kit's layers, for loading its archive
from bigmem_train.config import load_config
from bigmem_train.model.unet import build_unet
folder = {folder!r}
config = load_config(folder + "/config.yaml")
saved = keras.models.load_model(folder + "/checkpoints/best.keras", compile=False)
model = build_unet(config.model, {padded}, 1)  # the model at the padded volume's shape, as a user builds it
model.set_weights(saved.get_weights())
image = np.asarray(nib.load(folder + "/case.nii.gz").dataobj[..., 0], dtype=np.float32)
brain = image != 0
image[brain] = (image[brain] - image[brain].mean()) / image[brain].std()
volume = np.zeros((1, *{padded}, 1), np.float32)
volume[0, :, :, 2:157, 0] = image
start = time.perf_counter()
probabilities = model.predict(volume, verbose=0)
seconds = time.perf_counter() - start
mask = (probabilities[0, :, :, 2:157, 0] >= 0.5).astype(np.uint8)
np.save(folder + "/peer_mask.npy", mask)
print(json.dumps({{"seconds": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


VARIANTS = {
    "kit tensorflow float32": ["--engine", "tensorflow", "--precision", "float32"],
    "kit openvino float32": ["--engine", "openvino", "--precision", "float32"],
    "kit tensorflow bfloat16": ["--engine", "tensorflow", "--precision", "bfloat16"],
    "kit openvino bfloat16": ["--engine", "openvino", "--precision", "bfloat16"],
}


def run_kit(folder: Path, name: str, index: int) -> dict:
    out = folder / f"{name.replace(' ', '-')}-{index}"
    command = [sys.executable, "-m", "bigmem_train.cli", "predict", "--model", str(folder), "--data"]
    command += [str(folder / "case.nii.gz"), "--out", str(out), *VARIANTS[name]]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    case = json.loads((out / "predict.json").read_text())["cases"]["case"]
    return {
        "seconds": case["seconds"],
        "peak_rss_bytes": case["peak_rss_bytes"],
        "mode": case["mode"],
        "mask": str(out / "case.nii.gz"),
    }


def run_peer(folder: Path) -> dict:
    script = PEER.format(folder=str(folder), padded=PADDED)
    result = subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"default {RESULTS.relative_to(HERE.parent)}"
    )
    args = parser.parse_args()
    import nibabel as nib
    import numpy as np

    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(workdir)
        subprocess.run(
            [sys.executable, "-c", SETUP.format(folder=str(folder), shape=", ".join(map(str, SHAPE)))],
            check=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        names = ["peer", *args.variants]
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for index in range(args.repeats):
            for name in names:
                load = os.getloadavg()[0]
                result = run_peer(folder) if name == "peer" else run_kit(folder, name, index)
                result["load_before"] = load
                runs[name].append(result)
                print(
                    f"{name} {index + 1}: {result['seconds']:.2f} s, {result['peak_rss_bytes'] / 2**30:.2f} GiB "
                    f"(load {load:.2f})",
                    flush=True,
                )
        peer_mask = np.load(folder / "peer_mask.npy") > 0
        agreement = {}
        for name in args.variants:
            mask = np.asanyarray(nib.load(runs[name][0]["mask"]).dataobj) > 0
            total = mask.sum() + peer_mask.sum()
            agreement[name] = 1.0 if total == 0 else round(float(2 * (mask & peer_mask).sum() / total), 5)
            agreement[name + " foreground voxels"] = int(mask.sum())
    voxels = SHAPE[0] * SHAPE[1] * SHAPE[2]
    summary = {}
    for name, rows in runs.items():
        seconds = statistics.median(row["seconds"] for row in rows)
        summary[name] = {
            "median_seconds": round(seconds, 3),
            "voxels_per_second": round(voxels / seconds),
            "median_peak_gib": round(statistics.median(row["peak_rss_bytes"] for row in rows) / 2**30, 3),
        }
        if name != "peer":
            summary[name]["vs_peer_voxels_per_second"] = round(
                summary[name]["voxels_per_second"] / summary["peer"]["voxels_per_second"], 3
            )
            summary[name]["vs_peer_peak_memory"] = round(
                summary[name]["median_peak_gib"] / summary["peer"]["median_peak_gib"], 3
            )
    summary["mask_dice_agreement_with_peer"] = agreement
    from bigmem_train.host import cpu_isa, read_cpu_flags, read_cpu_model

    args.out.parent.mkdir(exist_ok=True)
    cpu = {"model": read_cpu_model(), "isa": cpu_isa(read_cpu_flags()), "cpus": os.cpu_count()}
    args.out.write_text(
        json.dumps({"shape": SHAPE, "padded": PADDED, "cpu": cpu, "runs": runs, "summary": summary}, indent=2)
        + "\n"
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
