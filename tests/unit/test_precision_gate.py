"""``predict --precision auto``: int8, then bfloat16, only where the CPU has it natively (int8 also only on
OpenVINO with NNCF) and its masks on the run's own validation cases stay within the Dice gate of float32's;
the gate's result cached beside the model (in the output folder where the model's folder is read-only), run
again for a changed model file, and predict.json saying which precision ran and why. ``--precision int8``
runs the same gate and is refused when int8 misses it (exit 1) or cannot run here (exit 2).

Stand-in engines (per-voxel functions, as in test_predict.py) play the float32, bfloat16 and int8 networks,
so whether the gate passes is decided here, not by an untrained model's rounding: ``truncated`` rounds the
probabilities to bfloat16's 8 significant bits (the masks stay float32's), ``flipped`` inverts them. The
real quantization is tested in test_int8.py.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import sys

import numpy as np
import pytest

import bigmem_train.host as host
import bigmem_train.infer.int8 as int8
import bigmem_train.infer.precision as precision
import bigmem_train.infer.predict as predict_module
from bigmem_train.cli import main
from bigmem_train.config import load_config
from bigmem_train.infer.precision import (
    GATE_FILE,
    PrecisionChoice,
    choose_precision,
    judge,
)
from bigmem_train.infer.predict import PredictRequest
from bigmem_train.infer.source import ModelSource, resolve_images
from tests.unit.test_predict import _image, labelled_run, pointwise, run_dir  # noqa: F401  (run_dir: a fixture)

BFLOAT16_CPU = ["avx512f", "avx512_bf16"]
# The EPYC: AVX-512 with AVX512_BF16 and VNNI, no AMX.
INT8_CPU = ["avx512f", "avx512_bf16", "avx512_vnni"]
VALIDATION = ["c2", "c4"]


def truncated(volume):
    """float32's probabilities with bfloat16's mantissa (truncated): a threshold at 0.5 keeps every voxel."""
    probabilities = pointwise(volume).astype(np.float32)
    return (probabilities.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def flipped(volume):
    return 1 - pointwise(volume)


@pytest.fixture
def run(tmp_path):
    """A run folder (config.yaml naming its dataset, split.json, checkpoints/best.keras) and a labelled
    Decathlon dataset of four cases, two of them the run's validation cases."""
    folder = labelled_run(tmp_path, (16, 16, 12), VALIDATION)
    (folder / "checkpoints" / "best.keras").write_bytes(b"weights, version 1")
    return folder


def _request(run, tmp_path, engine="tensorflow", out="out"):
    config = load_config(run / "config.yaml")
    source = ModelSource(run / "checkpoints" / "best.keras", config, run / "config.yaml", 1, 1)
    image = _image(tmp_path / "new.nii.gz", (16, 16, 12), seed=9)
    return PredictRequest(source, resolve_images([str(image)]), tmp_path / out, engine=engine)


@pytest.fixture
def engines(monkeypatch):
    """The gate's engines by precision (float32: ``pointwise``, bfloat16 and int8: ``truncated`` unless a
    test says otherwise), and how many were made and how many volumes each predicted. NNCF counts as
    installed (a test removes it where it needs it gone)."""
    record = {
        "made": [],
        "calls": {"float32": 0, "bfloat16": 0},
        "network": {"bfloat16": truncated, "int8": truncated},
    }

    def make_engine(name, model_path, precision_name):
        record["made"].append(precision_name)
        network = record["network"].get(precision_name, pointwise)

        def engine(volume):
            record["calls"][precision_name] = record["calls"].get(precision_name, 0) + 1
            return network(volume)

        return engine

    monkeypatch.setattr(precision, "make_engine", make_engine)
    monkeypatch.setattr(
        precision, "make_int8_engine", lambda source, engine: make_engine(engine, None, "int8")
    )
    monkeypatch.setattr(int8, "nncf_available", lambda: True)
    return record


@pytest.fixture
def openvino(monkeypatch):
    """The engine named is the engine used (OpenVINO counts as installed)."""
    monkeypatch.setattr(precision, "resolve_engine", lambda name: name)


def test_the_gate_bounds_are_inclusive_to_evaluates_four_decimals():
    reference = {"whole tumour": 0.9000, "tumour core": 0.8000}
    # Drops of exactly 0.005 and agreements of exactly 0.99 pass.
    assert (
        judge(
            reference,
            {"whole tumour": 0.8950, "tumour core": 0.7950},
            {"whole tumour": 0.99, "tumour core": 0.99},
        )
        == []
    )
    # A candidate better than float32 passes.
    assert (
        judge(
            reference,
            {"whole tumour": 0.9100, "tumour core": 0.8000},
            {"whole tumour": 1.0, "tumour core": 1.0},
        )
        == []
    )
    # 0.0051 below float32 in one region, 0.9899 agreement in the other: each fails, and names its region.
    failures = judge(
        reference,
        {"whole tumour": 0.8949, "tumour core": 0.8000},
        {"whole tumour": 0.9950, "tumour core": 0.9899},
    )
    assert failures == [
        "whole tumour pooled Dice 0.8949 against float32's 0.9000 (drop 0.0051 > 0.005)",
        "tumour core agreement with float32's masks 0.9899 < 0.99",
    ]


def test_auto_takes_bfloat16_when_its_masks_pass_the_gate_and_caches_the_figures(run, tmp_path, engines):
    request = _request(run, tmp_path)
    choice = choose_precision(request, "auto", BFLOAT16_CPU)
    assert choice.precision == "bfloat16" and choice.requested == "auto"
    assert engines["made"] == ["float32", "bfloat16"]
    assert engines["calls"] == {"float32": len(VALIDATION), "bfloat16": len(VALIDATION)}
    gate = choice.gates["bfloat16"]
    assert gate["passed"] and gate["failures"] == [] and sorted(gate["cases"]) == VALIDATION
    assert gate["agreement_dice"] == {"foreground": 1.0}
    assert gate["pooled_dice"]["bfloat16"] == gate["pooled_dice"]["float32"]
    assert 0 < gate["pooled_dice"]["float32"]["foreground"] < 1
    assert "within the Dice gate of float32 on 2 validation case(s)" in choice.reason
    assert "checked now" in choice.reason and str(run / "checkpoints" / GATE_FILE) in choice.reason
    cached = json.loads((run / "checkpoints" / GATE_FILE).read_text())["gates"]
    (key,) = cached
    assert key.endswith(" tensorflow bfloat16") and cached[key]["agreement_dice"] == {"foreground": 1.0}


def test_auto_keeps_float32_when_bfloat16_misses_the_gate(run, tmp_path, engines):
    engines["network"]["bfloat16"] = flipped
    choice = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    assert choice.precision == "float32"
    gate = choice.gates["bfloat16"]
    assert not gate["passed"] and gate["agreement_dice"]["foreground"] < 0.5
    assert "bfloat16 missed the Dice gate of float32 on 2 validation case(s)" in choice.reason
    assert "foreground agreement with float32's masks" in choice.reason
    assert "drop" in choice.reason  # the flipped masks lose Dice against the labels too
    # A missed gate is cached as well: the next predict does not run it again.
    engines["made"].clear()
    again = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    assert again.precision == "float32" and engines["made"] == [] and "missed" in again.reason


def test_a_cached_gate_is_used_without_predicting_again(run, tmp_path, engines, monkeypatch):
    first = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    engines["made"].clear()
    engines["calls"] = {"float32": 0, "bfloat16": 0}
    second = choose_precision(_request(run, tmp_path, out="elsewhere"), "auto", BFLOAT16_CPU)
    assert second.precision == "bfloat16" and engines["made"] == [] and engines["calls"]["float32"] == 0
    assert f"from {run / 'checkpoints' / GATE_FILE}" in second.reason
    assert second.gates["bfloat16"]["agreement_dice"] == first.gates["bfloat16"]["agreement_dice"]
    # Another engine computes otherwise: its own gate.
    monkeypatch.setattr(precision, "resolve_engine", lambda name: name)
    choose_precision(_request(run, tmp_path, engine="openvino"), "auto", BFLOAT16_CPU)
    assert engines["made"] == ["float32", "bfloat16"]


def test_a_changed_model_file_runs_its_gate_again(run, tmp_path, engines):
    choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    (run / "checkpoints" / "best.keras").write_bytes(b"weights, version 2")
    engines["made"].clear()
    engines["network"]["bfloat16"] = flipped
    choice = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    assert engines["made"] == ["float32", "bfloat16"] and choice.precision == "float32"
    assert len(json.loads((run / "checkpoints" / GATE_FILE).read_text())["gates"]) == 2


def test_a_read_only_model_folder_keeps_the_gate_in_the_output_folder(run, tmp_path, engines, monkeypatch):
    real_write = precision.write_json
    model_folder = run / "checkpoints"

    def read_only(path, data):
        if path.parent == model_folder:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real_write(path, data)

    monkeypatch.setattr(precision, "write_json", read_only)
    request = _request(run, tmp_path)
    choice = choose_precision(request, "auto", BFLOAT16_CPU)
    assert choice.precision == "bfloat16" and not (model_folder / GATE_FILE).exists()
    kept = request.out_dir / GATE_FILE
    assert f"{model_folder} cannot be written (Read-only file system): kept in {kept}" in choice.reason
    assert choice.gates["bfloat16"]["file"] == str(kept)
    engines["made"].clear()
    again = choose_precision(request, "auto", BFLOAT16_CPU)
    assert again.precision == "bfloat16" and engines["made"] == [] and f"from {kept}" in again.reason


def test_a_cpu_without_native_int8_or_bfloat16_runs_float32_without_a_gate(run, tmp_path, engines):
    choice = choose_precision(_request(run, tmp_path, engine="openvino"), "auto", ["avx2", "avx512f"])
    assert choice == PrecisionChoice(
        "float32",
        "auto",
        "no native int8 or bfloat16 on this CPU (int8 needs VNNI or AMX, bfloat16 AVX512_BF16 or AMX)",
    )
    assert engines["made"] == [] and not (run / "checkpoints" / GATE_FILE).exists()


@pytest.mark.parametrize("asked", ["float32", "bfloat16"])
def test_an_explicit_precision_is_obeyed_without_a_gate(run, tmp_path, engines, asked):
    choice = choose_precision(_request(run, tmp_path), asked, BFLOAT16_CPU)
    assert (choice.precision, choice.requested, choice.gates) == (asked, asked, None)
    assert choice.reason == f"--precision {asked}, as asked (no gate)"
    assert engines["made"] == [] and not (run / "checkpoints" / GATE_FILE).exists()


def test_without_labelled_validation_cases_auto_runs_float32_and_says_why(run, tmp_path, engines):
    (run / "split.json").unlink()  # a .keras file outside its run
    choice = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    assert choice.precision == "float32"
    assert choice.reason.startswith("bfloat16 not checked: no labelled validation cases:")
    (run / "split.json").write_text(json.dumps({"train": ["c1"], "validation": ["c2", "c9"]}))
    choice = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    assert choice.precision == "float32" and "validation case(s) and their labels are not in" in choice.reason
    assert engines["made"] == []


def test_plan_only_reports_the_cached_decision_and_runs_no_gate(run, tmp_path, engines):
    pending = choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU, run=False)
    assert pending.precision == "float32" and "has not run for this model" in pending.reason
    assert engines["made"] == []
    choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU)
    engines["made"].clear()
    assert choose_precision(_request(run, tmp_path), "auto", BFLOAT16_CPU, run=False).precision == "bfloat16"
    assert engines["made"] == []


def test_predict_json_and_its_summary_line_say_which_precision_ran_and_why(
    run,
    run_dir,  # noqa: F811
    tmp_path,
    engines,
    monkeypatch,
    capsys,
):
    """The whole command: the gate (stand-in engines) picks bfloat16, the real tiny model predicts in it."""
    shutil.copy(run_dir / "checkpoints" / "best.keras", run / "checkpoints" / "best.keras")
    monkeypatch.setattr(host, "read_cpu_flags", lambda root=None: BFLOAT16_CPU)
    image = _image(tmp_path / "new.nii.gz", (16, 16, 12), seed=9)
    arguments = ["predict", "--model", str(run), "--data", str(image), "--engine", "tensorflow"]
    assert main([*arguments, "--out", str(tmp_path / "auto")]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "auto" / "predict.json").read_text())
    assert (summary["precision"], summary["precision_requested"]) == ("bfloat16", "auto")
    assert summary["precision_reason"].startswith("bfloat16 within the Dice gate of float32 on 2 validation")
    assert summary["precision_gate"]["bfloat16"]["agreement_dice"] == {"foreground": 1.0}
    assert f"bigmem-train: precision bfloat16 ({summary['precision_reason']})" in printed
    assert "PREDICTED 1 case(s) in" in printed and "(bfloat16)" in printed.splitlines()[-1]

    assert main([*arguments, "--out", str(tmp_path / "asked"), "--precision", "float32"]) == 0
    summary = json.loads((tmp_path / "asked" / "predict.json").read_text())
    assert (summary["precision"], summary["precision_requested"]) == ("float32", "float32")
    assert summary["precision_reason"] == "--precision float32, as asked (no gate)"
    assert summary["precision_gate"] is None


def test_auto_takes_int8_first_when_its_masks_pass_the_gate(run, tmp_path, engines, openvino):
    choice = choose_precision(_request(run, tmp_path, engine="openvino"), "auto", INT8_CPU)
    assert choice.precision == "int8" and engines["made"] == ["float32", "int8"]
    assert list(choice.gates) == ["int8"] and choice.gates["int8"]["passed"]
    assert choice.reason.startswith("int8 within the Dice gate of float32 on 2 validation case(s)")
    (key,) = json.loads((run / "checkpoints" / GATE_FILE).read_text())["gates"]
    layers = precision.float_layers_precision()
    assert key.endswith(f" openvino int8 float-layers={layers}")
    assert choice.gates["int8"]["float_layers"] == layers


def test_int8_is_judged_again_when_its_float_layers_run_at_another_precision(
    run, tmp_path, engines, openvino, monkeypatch
):
    """int8's masks depend on the precision of the layers NNCF left in float (bf16 where native): a gate
    judged with f32 float layers does not stand for bf16 ones."""
    monkeypatch.setattr(precision, "float_layers_precision", lambda: "f32")
    choose_precision(_request(run, tmp_path, engine="openvino"), "auto", INT8_CPU)
    engines["made"].clear()
    choose_precision(_request(run, tmp_path, engine="openvino"), "auto", INT8_CPU)
    assert engines["made"] == []
    monkeypatch.setattr(precision, "float_layers_precision", lambda: "bf16")
    choice = choose_precision(_request(run, tmp_path, engine="openvino"), "auto", INT8_CPU)
    assert engines["made"] == ["float32", "int8"] and choice.gates["int8"]["float_layers"] == "bf16"
    keys = sorted(json.loads((run / "checkpoints" / GATE_FILE).read_text())["gates"])
    assert [key.split(" ", 1)[1] for key in keys] == [
        "openvino int8 float-layers=bf16",
        "openvino int8 float-layers=f32",
    ]


def test_auto_falls_back_to_bfloat16_when_int8_misses_the_gate(run, tmp_path, engines, openvino):
    engines["network"]["int8"] = flipped
    choice = choose_precision(_request(run, tmp_path, engine="openvino"), "auto", INT8_CPU)
    assert choice.precision == "bfloat16"
    # float32's masks are predicted once and judge both candidates.
    assert engines["made"] == ["float32", "int8", "bfloat16"]
    assert engines["calls"] == {"float32": 2, "int8": 2, "bfloat16": 2}
    assert not choice.gates["int8"]["passed"] and choice.gates["bfloat16"]["passed"]
    assert choice.reason.startswith("bfloat16 within the Dice gate")
    assert "int8 missed the Dice gate of float32 on 2 validation case(s)" in choice.reason


@pytest.mark.parametrize("missing", ["engine", "nncf"])
def test_auto_skips_int8_without_openvino_or_nncf_and_says_why(
    run, tmp_path, engines, openvino, monkeypatch, missing
):
    engine = "tensorflow" if missing == "engine" else "openvino"
    if missing == "nncf":
        monkeypatch.setattr(int8, "nncf_available", lambda: False)
    choice = choose_precision(_request(run, tmp_path, engine=engine), "auto", INT8_CPU)
    assert choice.precision == "bfloat16" and engines["made"] == ["float32", "bfloat16"]
    why = (
        "the OpenVINO engine only, not --engine tensorflow"
        if missing == "engine"
        else "NNCF is not installed"
    )
    assert why in choice.gates["int8"]["skipped"]
    assert "; int8 skipped: " in choice.reason and why in choice.reason


def _int8_command(run, tmp_path, out="int8"):
    image = _image(tmp_path / "new.nii.gz", (16, 16, 12), seed=9)
    return ["predict", "--model", str(run), "--data", str(image), "--out", str(tmp_path / out)]


@pytest.mark.parametrize("missing", ["vnni", "nncf", "openvino engine"])
def test_explicit_int8_is_refused_in_one_line_before_anything_runs(
    run, tmp_path, engines, monkeypatch, capsys, missing
):
    flags, engine = INT8_CPU, "openvino"
    if missing == "vnni":
        flags = BFLOAT16_CPU
    elif missing == "nncf":
        monkeypatch.undo()  # the real nncf_available, with the import made to fail
        monkeypatch.setitem(sys.modules, "nncf", None)
    else:
        engine = "tensorflow"
    monkeypatch.setattr(host, "read_cpu_flags", lambda root=None: flags)
    assert main([*_int8_command(run, tmp_path), "--engine", engine, "--precision", "int8"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert {
        "vnni": "VNNI or AMX",
        "nncf": "NNCF is not installed",
        "openvino engine": "OpenVINO engine only",
    }[missing] in error
    assert engines["made"] == [] and not (tmp_path / "int8").exists()


def test_explicit_int8_missing_the_gate_is_refused_with_both_dice_figures_and_no_masks(
    run,
    run_dir,  # noqa: F811
    tmp_path,
    engines,
    monkeypatch,
    capsys,
):
    shutil.copy(run_dir / "checkpoints" / "best.keras", run / "checkpoints" / "best.keras")
    engines["network"]["int8"] = flipped
    monkeypatch.setattr(host, "read_cpu_flags", lambda root=None: INT8_CPU)
    command = [*_int8_command(run, tmp_path), "--engine", "openvino", "--precision", "int8"]
    assert main(command) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--precision int8: refused, the int8 masks miss the Dice gate of float32 on 2 validation" in error
    assert re.search(r"foreground pooled Dice int8 0\.\d{4} vs float32 0\.\d{4}, agreement 0\.\d{4}", error)
    assert engines["made"] == ["float32", "int8"]
    out = tmp_path / "int8"
    assert not list(out.glob("*.nii.gz")) and not (out / "predict.json").exists()
    # The missed gate is cached: refused again without predicting.
    engines["made"].clear()
    assert main(command) == 1 and engines["made"] == []


def test_explicit_int8_that_passes_the_gate_predicts_and_says_so(
    run,
    run_dir,  # noqa: F811
    tmp_path,
    engines,
    monkeypatch,
    capsys,
):
    shutil.copy(run_dir / "checkpoints" / "best.keras", run / "checkpoints" / "best.keras")
    monkeypatch.setattr(host, "read_cpu_flags", lambda root=None: INT8_CPU)
    made = []

    def stand_in(request):
        made.append(request.precision)
        return pointwise

    monkeypatch.setattr(predict_module, "make_predict_engine", stand_in)
    assert main([*_int8_command(run, tmp_path), "--engine", "openvino", "--precision", "int8"]) == 0
    summary = json.loads((tmp_path / "int8" / "predict.json").read_text())
    assert (summary["precision"], summary["precision_requested"]) == ("int8", "int8")
    assert summary["precision_reason"].startswith("--precision int8, within the Dice gate of float32 on 2")
    assert summary["precision_gate"]["int8"]["passed"] and made == ["int8"]
    assert "(int8)" in capsys.readouterr().out.splitlines()[-1]


def test_int8_is_planned_as_float32_and_its_quantization_must_fit(run, tmp_path, monkeypatch):
    """OpenVINO keeps float32 tensors between some int8 layers (memory/inference.py): float32's plan; and
    the one-time quantization (the conversion's envelope, the calibration crops, a crop's forward pass)."""
    from dataclasses import replace

    from bigmem_train.errors import DoesNotFit
    from bigmem_train.infer.int8 import CALIBRATION_CROPS
    from bigmem_train.memory.inference import conversion_peak_bytes, quantization_peak_bytes
    from bigmem_train.memory.layers import layer_table

    monkeypatch.setattr(predict_module, "resolve_engine", lambda name: name)
    # This host's memory out of it: --target is the limit, 1 TiB without it.
    monkeypatch.setattr(predict_module, "limit_for", lambda target, margin: (int(target or 2**40), "limit"))
    request = _request(run, tmp_path, engine="openvino")
    float32 = predict_module.plan_cases(request)
    int8_plans = predict_module.plan_cases(replace(request, precision="int8"))
    assert {name: plan.peak_bytes for name, plan in int8_plans.items()} == {
        name: plan.peak_bytes for name, plan in float32.items()
    }
    config = request.source.config
    table = layer_table(config)
    planned = predict_module.planned_quantization_bytes(request.source)
    assert planned == quantization_peak_bytes(config, table, CALIBRATION_CROPS)
    crops = CALIBRATION_CROPS * 16**3 * config.num_channels * 4
    assert planned > conversion_peak_bytes(table) + crops
    between = (conversion_peak_bytes(table) + planned) // 2
    predict_module.plan_cases(replace(request, target=str(between)))
    with pytest.raises(DoesNotFit, match="one-time int8 quantization"):
        predict_module.plan_cases(replace(request, precision="int8", target=str(between)))


def test_int8_is_predicted_by_the_quantized_engine_and_the_others_by_the_saved_model(monkeypatch):
    from types import SimpleNamespace

    # Stand-ins for the two engine makers, recording what each was asked.
    calls = []
    monkeypatch.setattr(
        int8, "make_int8_engine", lambda source, engine: calls.append(("int8", source, engine))
    )
    monkeypatch.setattr(
        predict_module,
        "make_engine",
        lambda name, path, precision: calls.append(("saved", name, path, precision)),
    )
    monkeypatch.setattr(predict_module, "resolve_engine", lambda name: f"resolved {name}")
    source = SimpleNamespace(model_path="run/checkpoints/best.keras")
    for chosen in ("int8", "bfloat16", "float32"):
        predict_module.make_predict_engine(SimpleNamespace(precision=chosen, source=source, engine="auto"))
    assert calls == [
        ("int8", source, "resolved auto"),
        ("saved", "auto", "run/checkpoints/best.keras", "bfloat16"),
        ("saved", "auto", "run/checkpoints/best.keras", "float32"),
    ]
