"""``predict --precision bfloat16`` really computes in bfloat16: the TensorFlow engine's layers under the
mixed_bfloat16 policy, OpenVINO's network compiled with a bf16 inference precision (and float32 with f32:
on a CPU with native bfloat16, OpenVINO's default is bf16), the plan counting 2-byte activations, and the
probabilities a little (not zero, not much) off the float32 ones. Equal masks could not tell any of this.

The untrained tiny U-Net of ``run_dir`` (tests/unit/test_predict.py) stands in for a trained model.
"""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from bigmem_train.errors import BadInput
from bigmem_train.host import read_cpu_flags
from bigmem_train.infer.engine import check_precision, make_engine
from bigmem_train.infer.predict import PredictRequest, plan_cases, predict
from bigmem_train.infer.source import ImageCase, resolve_images, resolve_model
from tests.unit.test_predict import run_dir  # noqa: F401  (the module-scoped run directory fixture)


def _native_bfloat16() -> bool:
    try:
        check_precision("bfloat16", read_cpu_flags())
    except BadInput:
        return False
    return True


needs_native_bfloat16 = pytest.mark.skipif(
    not _native_bfloat16(), reason="this CPU has no native bfloat16 (AMX or AVX512_BF16); predict refuses it"
)
# One input for both precisions: a (1, X, Y, Z, C) normalized volume.
VOLUME = np.random.default_rng(0).standard_normal((1, 16, 16, 16, 1)).astype(np.float32)
# bfloat16 keeps 8 significant bits: the untrained model's probabilities (about 0.05) move by about 1e-4,
# where two float32 engines agree to 2e-8.
SMALLEST_BFLOAT16_EFFECT = 1e-6
LARGEST_BFLOAT16_EFFECT = 0.01


def _assert_a_bfloat16_difference(float32: np.ndarray, bfloat16: np.ndarray) -> None:
    assert float32.dtype == bfloat16.dtype == np.float32 and float32.shape == bfloat16.shape
    difference = float(np.abs(float32 - bfloat16).max())
    assert SMALLEST_BFLOAT16_EFFECT < difference < LARGEST_BFLOAT16_EFFECT, (
        f"largest difference {difference:.2e} between the float32 and bfloat16 runs"
    )


@needs_native_bfloat16
def test_the_tensorflow_engine_computes_every_layer_but_the_output_in_bfloat16(run_dir):  # noqa: F811
    model_path = resolve_model(run_dir).model_path
    float32 = make_engine("tensorflow", model_path, "float32")
    bfloat16 = make_engine("tensorflow", model_path, "bfloat16")
    (output_name,) = bfloat16.model.output_names
    computing = [layer for layer in bfloat16.model.layers if type(layer).__name__ != "InputLayer"]
    assert len(computing) > 10
    for layer in computing:
        expected = "float32" if layer.name == output_name else "bfloat16"
        assert layer.compute_dtype == expected, f"{layer.name} computes in {layer.compute_dtype}"
        assert layer.variable_dtype == "float32", f"{layer.name} keeps its weights in {layer.variable_dtype}"
    assert {layer.compute_dtype for layer in float32.model.layers} == {"float32"}
    _assert_a_bfloat16_difference(float32(VOLUME), bfloat16(VOLUME))


@needs_native_bfloat16
def test_a_predict_on_openvino_compiles_with_the_precision_asked_for(run_dir, tmp_path, monkeypatch):  # noqa: F811
    ov = pytest.importorskip("openvino")
    compiled = []

    class RecordingCore(ov.Core):
        def compile_model(self, *arguments, **keywords):
            network = super().compile_model(*arguments, **keywords)
            compiled.append(network)
            return network

    monkeypatch.setattr(ov, "Core", RecordingCore)
    image = np.random.default_rng(1).integers(1, 800, size=(16, 16, 12, 2)).astype(np.int16)
    nib.save(nib.Nifti1Image(image, np.eye(4)), tmp_path / "case.nii.gz")
    source, cases = resolve_model(run_dir), resolve_images([str(tmp_path / "case.nii.gz")])
    probabilities = {}
    for precision in ("float32", "bfloat16"):
        out = tmp_path / precision
        request = PredictRequest(
            source, cases, out, probabilities=True, engine="openvino", precision=precision
        )
        predict(request)
        probabilities[precision] = np.asanyarray(nib.load(out / "case_probabilities.nii.gz").dataobj)
    hints = [str(network.get_property("INFERENCE_PRECISION_HINT")) for network in compiled]
    assert hints == [str(ov.Type.f32), str(ov.Type.bf16)]
    _assert_a_bfloat16_difference(probabilities["float32"], probabilities["bfloat16"])


def test_the_bfloat16_plan_counts_two_byte_activations(run_dir, tmp_path):  # noqa: F811
    source = resolve_model(run_dir)
    case = ImageCase("planned", tmp_path / "not-read.nii.gz", (96, 96, 60), 2)  # only its shape is planned
    plans = {
        precision: plan_cases(
            PredictRequest(source, [case], tmp_path / "out", engine="tensorflow", precision=precision)
        )["planned"]
        for precision in ("float32", "bfloat16")
    }
    float32, bfloat16 = plans["float32"], plans["bfloat16"]
    assert float32.mode == bfloat16.mode == "whole" and float32.window == bfloat16.window
    # The walk's largest live set is of hidden layers: 2 bytes a value instead of 4.
    assert bfloat16.forward_live_bytes == pytest.approx(float32.forward_live_bytes / 2, rel=0.05)
    assert bfloat16.peak_bytes < float32.peak_bytes
