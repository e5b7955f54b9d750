"""``predict --precision auto`` (the default): the fastest precision this CPU computes natively whose masks
stay within a Dice gate of float32's on the model's own validation volumes.

The candidates are the precisions faster than float32 that the CPU runs natively (:func:`.engine.native_precisions`:
int8 with VNNI or AMX, then bfloat16 with AVX512_BF16 or AMX), fastest first; the first that passes its gate
runs, else float32. int8 is a candidate only on the OpenVINO engine with NNCF installed (the ``int8`` extra):
elsewhere it is skipped and the reason says why. The gate of a candidate:

- the validation cases of the run the model was trained in (its ``split.json``), images and labels from the
  run's dataset (``data.path``) or a Decathlon folder given to ``--data``, predicted as ``predict`` predicts
  them (whole or in planned tiles; no TTA: the gate judges the network's arithmetic) in float32 and in the
  candidate;
- scored by evaluate's own code (:mod:`bigmem_train.verdict.evaluate`) for every structure it reports (the
  foreground, or each class and the BraTS regions): the candidate's Dice pooled over the cases against the
  labels at most :data:`MAX_POOLED_DICE_DROP` below float32's, and its masks' pooled Dice against
  float32's masks (their agreement) at least :data:`MIN_AGREEMENT_DICE`. Figures as evaluate reports them
  (4 decimals); a figure on a bound passes.

Without labelled validation cases (a ``.keras`` file outside its run, a dataset not on this host) auto
runs float32 and says why: agreement alone is not accepted, since masks that agree at 0.99 overall can still
lose a small region's Dice, which only the labels show.

``--precision int8`` asked for explicitly runs the same gate (cached alike) and is refused when int8 misses
it (:func:`.int8.refusal`, exit 1, both Dice figures) or when the gate cannot run (exit 2): int8's rounding
is coarse enough that its masks are never taken unchecked. float32 and bfloat16 asked for run as asked.

A gate's result is cached per (model file digest, engine, precision) in ``precision-gate.json`` beside the
model file, with its figures; where that folder cannot be written (a read-only mount) in the output folder,
and the reason says so. A changed model file has another digest: its gate runs again.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bigmem_train.data.prepare import prepare_image
from bigmem_train.data.reader import Case, read_index
from bigmem_train.errors import BadInput, DoesNotFit
from bigmem_train.infer.engine import file_digest, make_engine, native_precisions, resolve_engine
from bigmem_train.infer.int8 import float_layers_precision, int8_unavailable, make_int8_engine, refusal
from bigmem_train.infer.predict import PredictRequest, labels_from, plan_cases, predict_probabilities
from bigmem_train.infer.source import ImageCase, ModelSource, validation_names
from bigmem_train.verdict.evaluate import _load_volume, _structures_for, score_case, summarize
from bigmem_train.verdict.rundir import write_json

# The gate (issue 48): a candidate's pooled Dice against the labels may fall this much below float32's,
# per structure, and its masks must agree with float32's at least this well (pooled Dice), per structure.
MAX_POOLED_DICE_DROP = 0.005
MIN_AGREEMENT_DICE = 0.99
GATE_FILE = "precision-gate.json"
# evaluate reports Dice to 4 decimals; the gate compares those figures, in these units (exact integers).
_DICE_UNITS = 10_000


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision predict runs, what was asked for, why, and the gates' figures (by candidate)."""

    precision: str
    requested: str
    reason: str
    gates: dict | None = None

    def record(self) -> dict:
        """predict.json's fields."""
        return {
            "precision": self.precision,
            "precision_requested": self.requested,
            "precision_reason": self.reason,
            "precision_gate": self.gates,
        }


class GateUnavailable(Exception):
    """The gate cannot run here (no labelled validation cases, or they cannot be read or planned)."""


def judge(reference: dict[str, float], candidate: dict[str, float], agreement: dict[str, float]) -> list[str]:
    """The gate's failures (empty: passed): per structure, ``candidate``'s pooled Dice against the labels
    more than MAX_POOLED_DICE_DROP below ``reference``'s (float32's), or its agreement with float32's masks
    below MIN_AGREEMENT_DICE. Compared in units of 1e-4, so a figure on a bound passes exactly."""
    failures = []
    for structure, float32_dice in reference.items():
        drop = round(float32_dice * _DICE_UNITS) - round(candidate[structure] * _DICE_UNITS)
        if drop > round(MAX_POOLED_DICE_DROP * _DICE_UNITS):
            failures.append(
                f"{structure} pooled Dice {candidate[structure]:.4f} against float32's {float32_dice:.4f} "
                f"(drop {drop / _DICE_UNITS:.4f} > {MAX_POOLED_DICE_DROP})"
            )
    for structure, value in agreement.items():
        if round(value * _DICE_UNITS) < round(MIN_AGREEMENT_DICE * _DICE_UNITS):
            failures.append(f"{structure} agreement with float32's masks {value:.4f} < {MIN_AGREEMENT_DICE}")
    return failures


def _thresholds() -> dict:
    return {"max_pooled_dice_drop": MAX_POOLED_DICE_DROP, "min_agreement_dice": MIN_AGREEMENT_DICE}


def gate_key(digest: str, engine: str, precision: str) -> str:
    """The cache key of a gate: the model file, the engine and the precision; int8's names the precision its
    float layers run at too (:func:`.int8.float_layers_precision`), which changes its masks."""
    if precision == "int8":
        precision = f"int8 float-layers={float_layers_precision()}"
    return f"{digest} {engine} {precision}"


def gate_files(model_path: Path, out_dir: Path) -> list[Path]:
    """Where a gate's result is kept: beside the model file, else in the output folder."""
    return [model_path.parent / GATE_FILE, out_dir / GATE_FILE]


def _entries(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text()).get("gates", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return entries if isinstance(entries, dict) else {}


def cached_gate(files: Sequence[Path], key: str) -> tuple[dict, Path] | tuple[None, None]:
    """The cached result for ``key`` and its file; a result judged by other bounds does not count."""
    for path in files:
        record = _entries(path).get(key)
        if isinstance(record, dict) and record.get("thresholds") == _thresholds() and "passed" in record:
            return record, path
    return None, None


def store_gate(files: Sequence[Path], key: str, record: dict) -> tuple[Path | None, str]:
    """Write ``record`` into the first of ``files`` that can be written (atomically, its other entries kept);
    (the file or None, what to say about where it went). Never fails the predict."""
    refused = []
    for path in files:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, {"gates": {**_entries(path), key: record}})
        except OSError as error:
            refused.append(f"{path.parent} cannot be written ({error.strerror or error})")
            continue
        return path, (f"; {refused[0]}: kept in {path}" if refused else f"; cached in {path}")
    return None, f"; not cached: {'; '.join(refused)}"


def gate_cases(source: ModelSource, dataset_dirs: Sequence[Path] = ()) -> list[Case]:
    """The run's validation cases with their labels, from the run's dataset or one of ``dataset_dirs``;
    GateUnavailable saying what is missing."""
    try:
        names = validation_names(source)
    except BadInput:
        raise GateUnavailable(
            f"no labelled validation cases: {source.model_path} is not in the run it was trained in "
            f"(no split.json beside {source.config_path.name})"
        ) from None
    folders = []
    for folder in [source.config.data.path, *dataset_dirs]:
        if folder is not None and Path(folder) not in folders:
            folders.append(Path(folder))
    for folder in folders:
        if not (folder / "dataset.json").is_file():
            continue
        try:
            cases = [case for case in read_index(folder) if case.name in names]
        except BadInput:
            continue
        if len(cases) == len(names):
            return cases
    where = ", ".join(str(folder) for folder in folders) or "no dataset folder"
    raise GateUnavailable(
        f"the run's {len(names)} validation case(s) and their labels are not in {where} "
        f"(give the dataset's Decathlon folder to --data)"
    )


def _masks(request: PredictRequest, precision: str, cases: list[ImageCase], plans: dict, label: str) -> dict:
    """Every case's mask in ``precision``, zlib-compressed (a study-size mask is 9 MB, compressed ~0.1 MB)."""
    if precision == "int8":
        engine = make_int8_engine(request.source, resolve_engine(request.engine))
    else:
        engine = make_engine(request.engine, request.source.model_path, precision)
    masks = {}
    for number, case in enumerate(cases, start=1):
        started = time.monotonic()
        image = prepare_image(case.path, request.source.config, case.channels)
        mask = labels_from(predict_probabilities(engine, image, plans[case.name]))
        masks[case.name] = (zlib.compress(mask.tobytes(), 1), mask.shape)
        print(
            f"predict: {label} {number}/{len(cases)} {case.name} {precision} in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    del engine
    return masks


def _unpacked(packed: tuple[bytes, tuple]) -> np.ndarray:
    data, shape = packed
    return np.frombuffer(zlib.decompress(data), dtype=np.uint8).reshape(shape).astype(np.int32)


def run_gate(
    request: PredictRequest, candidate: str, cases: list[Case], reference: dict | None = None
) -> dict:
    """Predict ``cases`` in float32 (unless ``reference`` holds its masks already) and in ``candidate``, score
    both against the labels and each other, and judge. ``reference`` is filled with float32's masks for
    the next candidate. GateUnavailable when a case cannot be planned or read."""
    reference = {} if reference is None else reference
    images = [ImageCase(case.name, case.image, case.shape, case.channels) for case in cases]
    label = f"precision gate ({candidate} against float32)"
    started = time.monotonic()
    try:
        gate_request = replace(request, cases=images, tta=False, probabilities=False)
        plans = {
            precision: plan_cases(replace(gate_request, precision=precision))
            for precision in ("float32", candidate)
        }
        if "masks" not in reference:
            reference["masks"] = _masks(gate_request, "float32", images, plans["float32"], label)
        masks = _masks(gate_request, candidate, images, plans[candidate], label)
        meta = {
            "label_mode": request.source.config.data.label_mode,
            "output_classes": request.source.config.model.output_classes,
        }
        named = None
        scores: dict[str, list] = {"float32": [], candidate: [], "agreement": []}
        for case in cases:
            label_image, true = _load_volume(case.label)
            float32, other = _unpacked(reference["masks"][case.name]), _unpacked(masks[case.name])
            if true.shape != float32.shape:
                raise BadInput(f"{case.label}: label shape {list(true.shape)} differs from its image's")
            if named is None:
                _, named = _structures_for(meta, float32, true)
            spacing = tuple(float(step) for step in label_image.header.get_zooms()[:3])
            scores["float32"] += score_case(case.name, float32, true, spacing, named)
            scores[candidate] += score_case(case.name, other, true, spacing, named)
            scores["agreement"] += score_case(case.name, other, float32, spacing, named)
    except (BadInput, DoesNotFit) as error:
        raise GateUnavailable(f"the run's validation cases cannot be predicted here ({error})") from None
    pooled = {
        name: {
            structure: row["pooled_dice"]
            for structure, row in summarize(rows, list(named))["summary"].items()
        }
        for name, rows in scores.items()
    }
    failures = judge(pooled["float32"], pooled[candidate], pooled["agreement"])
    float_layers = {"float_layers": float_layers_precision()} if candidate == "int8" else {}
    return {
        "precision": candidate,
        **float_layers,
        "engine": resolve_engine(request.engine),
        "model": str(request.source.model_path),
        "model_digest": file_digest(request.source.model_path),
        "thresholds": _thresholds(),
        "cases": [case.name for case in cases],
        "pooled_dice": {"float32": pooled["float32"], candidate: pooled[candidate]},
        "agreement_dice": pooled["agreement"],
        "passed": not failures,
        "failures": failures,
        "seconds": round(time.monotonic() - started, 1),
        "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _figures(record: dict) -> str:
    candidate = record["precision"]
    pooled = record["pooled_dice"]
    return "; ".join(
        f"{structure} pooled Dice {pooled[candidate][structure]:.4f} vs float32 {value:.4f}, "
        f"agreement {record['agreement_dice'][structure]:.4f}"
        for structure, value in pooled["float32"].items()
    )


def _gate(
    request: PredictRequest,
    candidate: str,
    dataset_dirs: Sequence[Path],
    reference: dict,
    run: bool,
) -> tuple[dict | None, str]:
    """``candidate``'s gate record (with its cache file under "file") and where it came from: the cache, or
    run now (None when not cached and ``run`` is False). GateUnavailable when it cannot run here."""
    engine = resolve_engine(request.engine)
    files = gate_files(request.source.model_path, request.out_dir)
    key = gate_key(file_digest(request.source.model_path), engine, candidate)
    record, found = cached_gate(files, key)
    if record is not None:
        return {**record, "file": str(found)}, f"; from {found}"
    if not run:
        return None, ""
    cases = gate_cases(request.source, dataset_dirs)
    print(
        f"predict: precision gate: {candidate} against float32 on the run's {len(cases)} validation "
        f"case(s), once per model ({engine})",
        file=sys.stderr,
        flush=True,
    )
    record = run_gate(request, candidate, cases, reference)
    found, where = store_gate(files, key, record)
    where = f"; checked now in {record['seconds']:.1f} s{where}"
    return {**record, "file": str(found) if found else None}, where


def _explicit_int8(request: PredictRequest, dataset_dirs: Sequence[Path], run: bool) -> PrecisionChoice:
    """``--precision int8``: int8 when it passes its gate; Int8Refused (exit 1) when it misses it, BadInput
    (exit 2) when the gate cannot run here."""
    try:
        record, where = _gate(request, "int8", dataset_dirs, {}, run)
    except GateUnavailable as error:
        raise BadInput(
            f"--precision int8: its masks must pass the Dice gate of float32, which cannot run here: {error}"
        ) from None
    if record is None:
        return PrecisionChoice(
            "int8", "int8", "--precision int8: its gate has not run for this model: predict runs it first"
        )
    if not record["passed"]:
        raise refusal(record)
    return PrecisionChoice(
        "int8",
        "int8",
        f"--precision int8, within the Dice gate of float32 on {len(record['cases'])} validation case(s) "
        f"({_figures(record)}){where}",
        {"int8": record},
    )


def choose_precision(
    request: PredictRequest,
    requested: str,
    cpu_flags: Sequence[str],
    dataset_dirs: Sequence[Path] = (),
    run: bool = True,
) -> PrecisionChoice:
    """The precision to predict in: float32 or bfloat16 as asked; int8 as asked when it passes its gate
    (else refused); for ``auto`` the fastest native candidate whose gate passes (cached, else run now unless
    ``run`` is False: ``--plan``), else float32; with the reason."""
    if requested == "int8":
        return _explicit_int8(request, dataset_dirs, run)
    if requested != "auto":
        return PrecisionChoice(requested, requested, f"--precision {requested}, as asked (no gate)")
    engine = resolve_engine(request.engine)
    gates: dict = {}
    notes: list[str] = []  # candidates skipped or not checked, said with whatever is chosen
    native = native_precisions(cpu_flags)
    candidates = []
    for candidate in native:
        skipped = int8_unavailable(engine) if candidate == "int8" else None
        if skipped is None:
            candidates.append(candidate)
        else:
            gates[candidate] = {"precision": candidate, "skipped": skipped}
            notes.append(f"int8 skipped: {skipped}")
    if not native:
        notes.append(
            "no native int8 or bfloat16 on this CPU (int8 needs VNNI or AMX, bfloat16 AVX512_BF16 or AMX)"
        )
    elif "bfloat16" not in native:
        notes.append("no native bfloat16 on this CPU (it needs AVX512_BF16 or AMX)")
    reference: dict = {}
    for candidate in candidates:
        try:
            record, where = _gate(request, candidate, dataset_dirs, reference, run)
        except GateUnavailable as error:
            notes.append(f"{candidate} not checked: {error}")
            continue
        if record is None:
            return PrecisionChoice(
                "float32",
                "auto",
                "; ".join(
                    [f"the {candidate} gate has not run for this model: predict runs it first", *notes]
                ),
                gates or None,
            )
        gates[candidate] = record
        if record["passed"]:
            reason = (
                f"{candidate} within the Dice gate of float32 on {len(record['cases'])} validation case(s) "
                f"({_figures(record)}){where}"
            )
            return PrecisionChoice(candidate, "auto", "; ".join([reason, *notes]), gates)
        print(
            f"predict: precision gate: {candidate} missed: {'; '.join(record['failures'])}", file=sys.stderr
        )
        notes.append(
            f"{candidate} missed the Dice gate of float32 on {len(record['cases'])} validation case(s) "
            f"({'; '.join(record['failures'])}){where}"
        )
    return PrecisionChoice("float32", "auto", "; ".join(notes), gates or None)
