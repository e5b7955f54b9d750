"""``bigmem-train predict``: segment whole volumes with a trained model.

Per case: the image is read and normalized by the training pipeline's own code (:mod:`bigmem_train.data.prepare`),
padded (centred, with zeros: the normalized background) to edges the U-Net's poolings divide, predicted as
one volume when the planner says it fits (:mod:`bigmem_train.memory.inference`), else in overlapping tiles
blended with a Gaussian weight (nnU-Net's sliding window: half-tile steps, sigma an eighth of the tile),
optionally averaged over the 8 mirrorings (``--tta``), cropped back, thresholded (one class) or arg-maxed
(several), and written as a uint8 NIfTI with the source's geometry. A case's file is written under a
hidden partial name and renamed: an interrupted predict leaves no file that looks finished, and a rerun
skips the cases already written. ``predict.json``, rewritten after every case, records how many cases were
asked for, the precision that ran and why (:mod:`.precision` decides ``--precision auto`` before this
runs), and each case's plan, time and the process's peak.

Bad input is refused before the model loads (exit 2, one line): every header when the images are named
(:mod:`.source`), every image to predict streamed once (whole, finite) after planning. A full output
filesystem stops with exit 3 and leaves no partial file.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from bigmem_train.data.prepare import prepare_image
from bigmem_train.data.reader import _placement, check_channels, check_image_file
from bigmem_train.errors import BadInput, BigmemError, DoesNotFit
from bigmem_train.host import read_host_facts
from bigmem_train.infer.engine import PRECISIONS, make_engine, resolve_engine
from bigmem_train.infer.nifti import (
    check_out_dir,
    like_source,
    output_path,
    write_atomically,
    write_error,
)
from bigmem_train.infer.source import ImageCase, ModelSource
from bigmem_train.memory.inference import (
    InferencePlan,
    conversion_peak_bytes,
    plan_volume,
    quantization_peak_bytes,
    tile_starts,
)
from bigmem_train.memory.layers import layer_table
from bigmem_train.sizes import format_bytes, parse_size
from bigmem_train.train.monitor import peak_rss_bytes
from bigmem_train.verdict.rundir import write_json

SUMMARY = "predict.json"
PROBABILITIES_SUFFIX = "_probabilities"


@dataclass
class PredictRequest:
    source: ModelSource
    cases: list[ImageCase]
    out_dir: Path
    tta: bool = False
    probabilities: bool = False
    target: str | None = None
    tile: tuple[int, int, int] | None = None
    engine: str = "auto"
    # The precision to run (float32, bfloat16 or int8); ``--precision auto`` is decided before by
    # infer/precision.py, which also runs int8's gate.
    precision: str = "float32"
    # predict.json's precision fields from that decision (PrecisionChoice.record); None: asked for as is.
    precision_choice: dict | None = None


def check_outputs(request: PredictRequest) -> None:
    """The output folder is writable and no output lands on an input or on another output: not the folder
    of an image (a mask is named as its image: it would pass for a written case, or be read as an image
    next time), and with ``--probabilities`` no case named as another's probabilities."""
    out_dir = request.out_dir.resolve()
    for case in request.cases:
        if case.path.parent.resolve() == out_dir:
            raise BadInput(
                f"--out {request.out_dir}: is the folder of the image {case.path}; masks are named as their "
                f"images, so give a folder of their own"
            )
    if request.probabilities:
        names = {case.name: case for case in request.cases}
        for case in request.cases:
            other = names.get(case.name + PROBABILITIES_SUFFIX)
            if other is not None:
                raise BadInput(
                    f"{case.path}: its probabilities would be written over the mask of {other.path} "
                    f"({output_path(request.out_dir, other.name).name}); rename one of them"
                )
    check_out_dir(request.out_dir)


def check_images(cases: list[ImageCase]) -> None:
    """Each image streamed once, before the model loads: complete, of real numbers, finite (a few threads:
    zlib decompresses outside the GIL); BadInput names the first bad one."""
    if not cases:
        return
    workers = max(1, min(4, os.cpu_count() or 1, len(cases)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="check-images") as pool:
        for _ in pool.map(check_image_file, [case.path for case in cases]):
            pass


def limit_for(target: str | None, safety_margin: float) -> tuple[int, str]:
    """The memory a prediction may plan for: the host's available memory (capped by a cgroup limit) less
    the job's safety margin, or ``--target`` (a size or a share of the host) when it is no more than that.
    A ``--target`` above the usable memory is a ceiling the host cannot give today (other processes hold
    the rest): the prediction plans within the usable memory and says so, as it would without a target;
    only a volume that cannot fit even in tiles is refused (plan_cases)."""
    host = read_host_facts()
    available = host.effective_memory_bytes
    usable = int(available * (1.0 - safety_margin))
    usable_why = f"usable memory ({format_bytes(available)} less {safety_margin:.0%})"
    if not target:
        return usable, usable_why
    try:
        limit = parse_size(target, host.limit_total_bytes)
    except BadInput as error:
        raise BadInput(f"--target {target}: {error}") from None
    if limit <= 0:
        raise BadInput(f"--target {target}: give a size above 0, e.g. 8GiB or 50%")
    if limit > usable:
        print(
            f"bigmem-train: --target {target} ({format_bytes(limit)}) is more than this host's usable memory "
            f"{format_bytes(usable)} ({format_bytes(available)} available less the {safety_margin:.0%} safety "
            "margin): planning within the usable memory",
            file=sys.stderr,
        )
        return usable, f"{usable_why}, less than --target {target} ({format_bytes(limit)})"
    return limit, f"--target {target}"


def plan_cases(request: PredictRequest) -> dict[str, InferencePlan]:
    """Every case planned before the model is loaded; DoesNotFit (exit 3) when one cannot fit even in tiles
    (after its file is checked: a header that claims more than its file holds is bad input, exit 2)."""
    config = request.source.config
    for case in request.cases:
        check_channels(case.path, case.channels, config)
    limit, _ = limit_for(request.target, config.footprint.safety_margin)
    # int8 is planned as float32 (memory/inference.py says why); bfloat16's forward pass holds bfloat16
    # tensors: the layer table of the job in mixed precision.
    if request.precision == "bfloat16":
        config = config.model_copy(
            update={"runtime": config.runtime.model_copy(update={"precision": "mixed_bfloat16"})}
        )
    table = layer_table(config)
    engine = resolve_engine(request.engine)
    plans = {}
    for case in request.cases:
        try:
            plans[case.name] = plan_volume(
                config, table, case.shape, case.channels, limit, request.tile, request.tta, engine
            )
        except DoesNotFit:
            check_image_file(case.path)
            raise
    if engine == "openvino":
        conversion = planned_conversion_bytes(request.source)
        if conversion > limit:
            raise DoesNotFit(
                f"OpenVINO's one-time conversion of the model needs about {format_bytes(conversion)}, more "
                f"than the {format_bytes(limit)} planned for: use --engine tensorflow"
            )
    if request.precision == "int8":
        quantization = planned_quantization_bytes(request.source)
        if quantization > limit:
            raise DoesNotFit(
                f"the one-time int8 quantization of the model needs about {format_bytes(quantization)}, more "
                f"than the {format_bytes(limit)} planned for: use --precision bfloat16 or float32"
            )
    return plans


def planned_conversion_bytes(source: ModelSource) -> int:
    """The host's peak while OpenVINO converts the model (float32, once per model; memory/inference.py)."""
    return conversion_peak_bytes(layer_table(source.config))


def planned_quantization_bytes(source: ModelSource) -> int:
    """The host's peak while NNCF quantizes the model to int8 (once per model; memory/inference.py)."""
    from bigmem_train.infer.int8 import CALIBRATION_CROPS

    config = source.config
    return quantization_peak_bytes(config, layer_table(config), CALIBRATION_CROPS)


def make_predict_engine(request: PredictRequest):
    """The engine for ``request.precision``: int8 is the OpenVINO model quantized once on the run's own
    training crops (:mod:`.int8`), the others the saved model in float32 or bfloat16 (:mod:`.engine`)."""
    if request.precision == "int8":
        from bigmem_train.infer.int8 import make_int8_engine

        return make_int8_engine(request.source, resolve_engine(request.engine))
    return make_engine(request.engine, request.source.model_path, request.precision)


def gaussian_weights(window: tuple[int, int, int], sigma_scale: float = 1 / 8) -> np.ndarray:
    """nnU-Net's tile weight: a Gaussian centred on the tile, sigma ``sigma_scale`` of each edge, scaled
    to a maximum of 1, its zeros raised to the smallest nonzero value (every voxel counts a little)."""
    axes = []
    for edge in window:
        centre, sigma = (edge - 1) / 2, max(edge * sigma_scale, 1e-3)
        axes.append(np.exp(-0.5 * ((np.arange(edge) - centre) / sigma) ** 2))
    weights = axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :]
    weights = (weights / weights.max()).astype(np.float32)
    weights[weights == 0] = weights[weights > 0].min()
    return weights


def _mirrored(forward, volume: np.ndarray, tta: bool) -> np.ndarray:
    """The forward pass of ``volume`` (1, X, Y, Z, C), averaged over the 8 mirrorings when ``tta``."""
    if not tta:
        return forward(volume)
    total = None
    flips = [axes for count in range(4) for axes in itertools.combinations((1, 2, 3), count)]
    for axes in flips:
        flipped = np.ascontiguousarray(np.flip(volume, axes)) if axes else volume
        prediction = forward(flipped)
        prediction = np.flip(prediction, axes) if axes else prediction
        total = prediction.copy() if total is None else total + prediction
    return total / len(flips)


def predict_probabilities(forward, image: np.ndarray, plan: InferencePlan, tta: bool = False) -> np.ndarray:
    """(X, Y, Z, K) probabilities for a normalized (X, Y, Z, C) image, whole or in tiles as planned."""
    shape = image.shape[:3]
    padded = plan.padded
    placements = [_placement(source, edge, 0, None) for source, edge in zip(shape, padded)]
    inside = tuple(slice(start, start + length) for _, start, length in placements)
    volume = np.zeros((1, *padded, image.shape[-1]), dtype=np.float32)
    volume[(0, *inside)] = image
    if plan.mode == "whole":
        probabilities = _mirrored(forward, volume, tta)[0]
    else:
        probabilities = _tiled(forward, volume, plan.window, tta)
    del volume
    return np.ascontiguousarray(probabilities[inside])


def _tiled(forward, volume: np.ndarray, window: tuple[int, int, int], tta: bool) -> np.ndarray:
    """Sliding window over the padded ``volume``: half-tile steps, Gaussian-weighted average."""
    padded = volume.shape[1:4]
    weights = gaussian_weights(window)
    total = None
    weight_sum = np.zeros(padded, dtype=np.float32)
    starts = [tile_starts(full, edge) for full, edge in zip(padded, window)]
    count, done, last_line = math.prod(len(axis) for axis in starts), 0, time.monotonic()
    for x, y, z in itertools.product(*starts):
        region = (slice(x, x + window[0]), slice(y, y + window[1]), slice(z, z + window[2]))
        prediction = _mirrored(forward, np.ascontiguousarray(volume[(slice(None), *region)]), tta)[0]
        if total is None:
            total = np.zeros((*padded, prediction.shape[-1]), dtype=np.float32)
        total[region] += prediction * weights[..., None]
        weight_sum[region] += weights
        done += 1
        if time.monotonic() - last_line >= 10:
            print(f"predict:   tile {done}/{count}", file=sys.stderr, flush=True)
            last_line = time.monotonic()
    total /= weight_sum[..., None]
    return total


def labels_from(probabilities: np.ndarray) -> np.ndarray:
    """One class: probability >= 0.5 is 1; several: the most probable class."""
    if probabilities.shape[-1] == 1:
        return (probabilities[..., 0] >= 0.5).astype(np.uint8)
    return np.argmax(probabilities, axis=-1).astype(np.uint8)


def predict(request: PredictRequest, plans: dict[str, InferencePlan] | None = None, engine=None) -> dict:
    """Predict every case not yet written; returns (and writes) the summary."""
    config = request.source.config
    if request.precision not in PRECISIONS:
        raise ValueError(
            f"precision {request.precision!r}: decide auto with infer.precision.choose_precision first"
        )
    check_outputs(request)
    plans = plans if plans is not None else plan_cases(request)
    todo = [case for case in request.cases if not output_path(request.out_dir, case.name).exists()]
    check_images(todo)
    print(
        f"predict: {len(request.cases)} case(s), {len(request.cases) - len(todo)} already written; "
        f"model {request.source.model_path}",
        file=sys.stderr,
        flush=True,
    )
    summary_path = request.out_dir / SUMMARY
    summary = _read_summary(summary_path)
    summary.update(
        {
            "model": str(request.source.model_path),
            "config": str(request.source.config_path),
            "engine": resolve_engine(request.engine),
            "precision_requested": request.precision,
            "precision_reason": "as asked",
            "precision_gate": None,
            **(request.precision_choice or {}),
            "precision": request.precision,  # what runs, whatever the choice says
            "tta": request.tta,
            "label_mode": config.data.label_mode,
            "output_classes": config.model.output_classes,
            "cases_total": len(request.cases),
        }
    )
    # Written now and after every case: `remote status` reads how far a prediction is from it.
    _write_summary(summary_path, summary)
    if todo and engine is None:
        engine = make_predict_engine(request)
        if getattr(engine, "name", None) == "openvino":
            summary["conversion"] = _conversion_record(engine, request.source)
            if request.precision == "int8":
                summary["quantization"] = {
                    "planned_peak_bytes": planned_quantization_bytes(request.source),
                    "cached": engine.quantization is None,
                    # OpenVINO's precision for the layers NNCF left in float (int8.float_layers_precision).
                    "float_layers": getattr(engine, "float_precision", None),
                    **(engine.quantization or {}),
                }
            _write_summary(summary_path, summary)
    for number, case in enumerate(todo, start=1):
        plan = plans[case.name]
        started = time.monotonic()
        image = prepare_image(case.path, config, case.channels)
        probabilities = predict_probabilities(engine, image, plan, request.tta)
        del image
        source = nib.load(case.path)
        probabilities_path = output_path(request.out_dir, case.name, PROBABILITIES_SUFFIX)
        if request.probabilities:
            write_atomically(like_source(source, probabilities, np.float32), probabilities_path)
        try:
            write_atomically(
                like_source(source, labels_from(probabilities), np.uint8),
                output_path(request.out_dir, case.name),
            )
        except BigmemError:
            if request.probabilities:  # a case is its mask: no probabilities without it
                probabilities_path.unlink(missing_ok=True)
            raise
        del probabilities
        seconds = time.monotonic() - started
        summary["cases"][case.name] = {
            "image": str(case.path),
            "output": output_path(request.out_dir, case.name).name,
            "shape": list(case.shape),
            "mode": plan.mode,
            "window": list(plan.window),
            "tiles": plan.tiles,
            "planned_peak_bytes": plan.peak_bytes,
            "plan": plan.to_dict(),
            "peak_rss_bytes": peak_rss_bytes(),
            "seconds": round(seconds, 3),
            "voxels_per_second": round(math.prod(case.shape) / seconds) if seconds > 0 else None,
        }
        _write_summary(summary_path, summary)
        print(
            f"predict: {number}/{len(todo)} {case.name} {'x'.join(map(str, case.shape))} {plan.mode}"
            f"{'' if plan.mode == 'whole' else ' ' + str(plan.tiles) + ' tiles'} in {seconds:.1f} s "
            f"(planned {format_bytes(plan.peak_bytes)}, process peak {format_bytes(peak_rss_bytes())})",
            file=sys.stderr,
            flush=True,
        )
    _write_summary(summary_path, summary)
    return summary


def _write_summary(path: Path, summary: dict) -> None:
    """predict.json, atomically; a failed write is exit 3 (full disk) or 2 with one line, as a mask's."""
    try:
        write_json(path, summary)
    except OSError as error:
        raise write_error(path, error) from None


def _conversion_record(engine, source: ModelSource) -> dict:
    """OpenVINO's conversion of the model, planned and (when it ran now, not from the cache) measured."""
    planned = planned_conversion_bytes(source)
    # The int8 engine converts inside its quantization (int8.quantized_model): reported there.
    done = getattr(engine, "conversion", None)
    record = {"planned_peak_bytes": planned, "cached": done is None}
    if done is not None:
        record.update(done)
        measured = done.get("peak_rss_bytes")
        print(
            f"predict: converted for OpenVINO in {done['seconds']:.1f} s: child peak "
            f"{format_bytes(measured) if measured else 'not reported'} (planned with this process "
            f"{format_bytes(planned)})",
            file=sys.stderr,
            flush=True,
        )
    return record


def _read_summary(path: Path) -> dict:
    try:
        summary = json.loads(path.read_text())
        if isinstance(summary, dict) and isinstance(summary.get("cases"), dict):
            return summary
    except (OSError, ValueError):
        pass
    return {"cases": {}}
