"""``--precision int8``: a tiny U-Net (depth 2, 4 filters, fixed weights) quantized by NNCF on its run's
training crops really runs OpenVINO's int8 kernels, answers close to float32, is quantized once per model
file and calibration set, and is refused in one line when NNCF is missing.

OpenVINO's float conversion (engine.py, a child process that imports TensorFlow: a minute on a loaded
CPU) runs once here, in this process; each model file gets a copy of it in its digest's folder, as
:func:`.engine.converted_model` would have made it. What is tested is the quantization beside it.
"""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.infer.source import ModelSource
from bigmem_train.model import upconv
from tests.unit.test_predict import labelled_run

pytest.importorskip("openvino")
pytest.importorskip("nncf")
int8 = pytest.importorskip("bigmem_train.infer.int8")

VOLUME = (1, 32, 32, 16, 1)
# Measured on this tiny U-Net and volume (seeded, calibrated on 6 crops of its run): largest probability
# difference int8 vs float32 0.0073, mean 0.00085. The bounds leave about 2.5x room for another CPU's rounding.
MAX_DIFFERENCE = 0.02
MEAN_DIFFERENCE = 0.002


def _save_model(path, seed):
    import keras

    from bigmem_train.model.unet import build_unet

    config = load_config(None, {"model.depth": 2, "model.base_filters": 4, "data.channels": [1]})
    keras.utils.set_random_seed(seed)
    build_unet(config.model, (16, 16, 16), 1).save(path)
    return path


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    """OpenVINO's float32 model.xml of the tiny U-Net, converted once by engine.py's own conversion."""
    from bigmem_train.infer.engine import _convert

    folder = tmp_path_factory.mktemp("float")
    model = _save_model(folder / "model.keras", seed=0)
    (folder / "ir").mkdir()
    _convert(model, folder / "ir" / "model.xml")
    return folder / "ir" / "model.xml"


@pytest.fixture
def run(tmp_path, float_model, monkeypatch):
    """A run (config.yaml naming its dataset, split.json, checkpoints/best.keras) whose converted model is
    the fixture's, in a cache folder of its own; and a count of NNCF's quantizations."""
    import nncf

    folder = labelled_run(tmp_path, (20, 18, 16), ["c2"])
    model_path = folder / "checkpoints" / "best.keras"
    shutil.copy(float_model.parent.parent / "model.keras", model_path)

    cache = tmp_path / "cache"

    def converted_model(path, converted=None):
        target = cache / int8.file_digest(path) / "model.xml"
        if not target.is_file():
            target.parent.mkdir(parents=True)
            shutil.copy(float_model, target)
            shutil.copy(float_model.with_suffix(".bin"), target.with_suffix(".bin"))
        return target

    monkeypatch.setattr(int8, "converted_model", converted_model)
    calls = []
    real_quantize = nncf.quantize

    def counted(*args, **kwargs):
        calls.append(kwargs.get("subset_size"))
        return real_quantize(*args, **kwargs)

    monkeypatch.setattr(nncf, "quantize", counted)
    source = ModelSource(model_path, load_config(folder / "config.yaml"), folder / "config.yaml", 1, 1)
    return {"source": source, "calls": calls, "cache": cache}


def _volume():
    return np.random.default_rng(7).standard_normal(VOLUME).astype(np.float32)


def test_the_int8_model_runs_int8_convolutions_and_answers_close_to_float32(run):
    import openvino as ov

    engine = int8.make_int8_engine(run["source"], count=6, float_precision="f32")
    assert run["calls"] == [6] and engine.quantization["crops"] == 6
    compiled = engine.compiled(VOLUME)
    layers: dict[str, list[str]] = {"Convolution": [], "Deconvolution": []}
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        if kind in layers:
            layers[kind].append(op.get_friendly_name())
    int8_layers = set(int8.int8_layers(compiled))
    # Every convolution (the first and the 1x1 output included) runs an int8 primitive; so do the two
    # up-convolutions. On a CPU with AVX-512 they are folded, each split in two by int8.prepared_for_int8: the
    # half reading the activations runs int8, the half reading the channel of ones (a bias map) stays float.
    # Without AVX-512 the model keeps them unfolded (upconv.fold_available): two, both int8.
    assert len(layers["Convolution"]) == 11 and set(layers["Convolution"]) <= int8_layers
    deconvolutions = 4 if upconv.fold_available() else 2
    assert (
        len(layers["Deconvolution"]) == deconvolutions
        and len(set(layers["Deconvolution"]) & int8_layers) == 2
    )

    core = ov.Core()
    float_model = core.read_model(int8.converted_model(run["source"].model_path))
    float_model.reshape(list(VOLUME))
    float32 = core.compile_model(float_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert int8.int8_layers(float32) == []
    volume = _volume()
    difference = np.abs(engine(volume) - np.asarray(float32(volume)[0]))
    assert difference.max() < MAX_DIFFERENCE and difference.mean() < MEAN_DIFFERENCE


def test_float_layers_run_bfloat16_where_the_cpu_has_it_natively(run):
    """What NNCF leaves in float runs at OpenVINO's bf16 hint on a CPU with native bfloat16 (this machine's
    choice, asserted where it has it), f32 elsewhere; the int8 convolutions stay int8 either way."""
    assert int8.float_layers_precision({"avx512_vnni", "avx512_bf16"}) == "bf16"
    assert int8.float_layers_precision({"avx512_vnni", "amx_bf16", "amx_int8"}) == "bf16"
    assert int8.float_layers_precision({"avx512_vnni"}) == "f32"
    assert int8.float_layers_precision(set()) == "f32"
    from bigmem_train.host import this_cpu_flags

    default = int8.make_int8_engine(run["source"], count=6)
    assert default.float_precision == int8.float_layers_precision(this_cpu_flags())
    if default.float_precision != "bf16":
        pytest.skip("this CPU has no native bfloat16: the float layers run float32")
    exact = int8.make_int8_engine(run["source"], count=6, float_precision="f32")

    def precisions(engine):
        compiled = engine.compiled(VOLUME)
        return {
            op.get_friendly_name(): op.get_rt_info()["runtimePrecision"].astype(str).upper()
            for op in compiled.get_runtime_model().get_ordered_ops()
            if "runtimePrecision" in op.get_rt_info()
        }

    fast, slow = precisions(default), precisions(exact)
    assert "BF16" in fast.values() and "BF16" not in slow.values()
    assert set(int8.int8_layers(default.compiled(VOLUME))) == set(int8.int8_layers(exact.compiled(VOLUME)))
    volume = _volume()
    difference = np.abs(default(volume) - exact(volume))
    # bfloat16 keeps 8 bits of mantissa: the probabilities move, a little (here max 0.00018, mean 0.00001).
    assert 0 < difference.max() < MAX_DIFFERENCE


def test_a_second_engine_reads_the_int8_model_without_quantizing_again(run):
    first = int8.make_int8_engine(run["source"], count=4)
    second = int8.make_int8_engine(run["source"], count=4)
    assert run["calls"] == [4] and second.quantization is None
    assert second.model_xml == first.model_xml and first.model_xml.parent.name == int8.file_digest(
        run["source"].model_path
    )
    assert not list(first.model_xml.parent.glob(".partial-*"))
    np.testing.assert_array_equal(first(_volume()), second(_volume()))


def test_a_changed_model_file_or_calibration_set_quantizes_again(run):
    first = int8.make_int8_engine(run["source"], count=4)
    _save_model(run["source"].model_path, seed=1)
    changed = int8.make_int8_engine(run["source"], count=4)
    more_crops = int8.make_int8_engine(run["source"], count=5)
    assert run["calls"] == [4, 4, 5]
    assert len({first.model_xml, changed.model_xml, more_crops.model_xml}) == 3


def test_calibration_reads_the_runs_training_crops_through_the_kits_reader(run):
    calibration = int8.calibration_from_run(run["source"], count=5)
    crops = list(calibration.batches())
    assert len(crops) == 5 and all(crop.shape == (1, 16, 16, 16, 1) for crop in crops)
    assert all(crop.dtype == np.float32 and abs(float(crop[crop != 0].mean())) < 1 for crop in crops)
    # The same run, the same key; another crop count, another.
    assert int8.calibration_from_run(run["source"], count=5).key == calibration.key
    assert int8.calibration_from_run(run["source"], count=4).key != calibration.key


def test_int8_without_nncf_is_refused_in_one_line_with_how_to_install(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "nncf", None)
    with pytest.raises(BadInput) as refused:
        int8.make_int8_engine(run["source"])
    message = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in message
    assert "NNCF is not installed" in message and "pip install" in message
    assert run["calls"] == []


def test_int8_runs_on_openvino_and_a_cpu_with_a_native_int8_dot_product_only():
    with pytest.raises(BadInput, match="OpenVINO engine only"):
        int8.check_int8("tensorflow")
    with pytest.raises(BadInput, match="VNNI or AMX"):
        int8.check_int8("openvino", ["avx512f", "avx512_bf16"])
    int8.check_int8("openvino", ["avx512f", "avx512_vnni"])


def test_a_missed_gate_is_refused_with_both_dice_figures_and_exit_1():
    record = {
        "cases": ["c2", "c4"],
        "pooled_dice": {"float32": {"foreground": 0.9012}, "int8": {"foreground": 0.8811}},
        "agreement_dice": {"foreground": 0.9701},
    }
    error = int8.refusal(record)
    assert error.exit_code == 1 and "\n" not in str(error)
    assert "int8 0.8811 vs float32 0.9012" in str(error) and "agreement 0.9701" in str(error)
