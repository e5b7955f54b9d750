"""kernel_check: the convolutions of a model that would get oneDNN's reference filter-gradient kernel."""

from bigmem_train.config import Config
from bigmem_train.model.kernel_check import GEMM_FAMILY, _parse_create, check_model, warn_reference_kernels


def test_study_tile_chunks_exactly_the_layer_past_the_limit(capsys, monkeypatch):
    """At the study's tile only up0_conv1 (32 -> 16 at 240x240x144) is past oneDNN's gemm limit; the kit's
    U-Net makes it a ChunkedConv3D, so on a gemm CPU nothing is expected on the reference kernel, while the
    same U-Net with plain Keras layers (the peer) is flagged, by layer name, with the slowdown."""
    import keras

    from bigmem_train.model import conv
    from bigmem_train.model.conv import ChunkedConv3D
    from bigmem_train.model.unet import build_unet

    monkeypatch.setattr(conv, "filter_gradient_runs_gemm", lambda: True)  # a gemm CPU (no AVX-512)
    config = Config()
    model = build_unet(config.model, (240, 240, 144), 1)
    chunked = [layer.name for layer in model.layers if isinstance(layer, ChunkedConv3D)]
    assert chunked == ["up0_conv1"]
    checks = check_model(model, family=GEMM_FAMILY)
    assert len(checks) == 19 and not any(check.reference for check in checks)
    assert {check.layer: check.chunk for check in checks if check.chunk} == {"up0_conv1": 120}

    plain = keras.models.clone_model(
        model,
        clone_function=lambda layer: (
            keras.layers.Conv3D.from_config(
                {key: value for key, value in layer.get_config().items() if key != "scratchpad_limit_bytes"}
            )
            if isinstance(layer, ChunkedConv3D)
            else layer.__class__.from_config(layer.get_config())
        ),
    )
    flagged = [check for check in check_model(plain, family=GEMM_FAMILY) if check.reference]
    assert [check.layer for check in flagged] == ["up0_conv1"]
    warnings = warn_reference_kernels(flagged)
    assert "up0_conv1" in warnings[0] and "ref:any" in warnings[0] and "x slower" in warnings[0]
    assert "bigmem-train: warning: layer up0_conv1" in capsys.readouterr().err


def test_other_kernel_families_have_no_gemm_limit():
    import keras

    inputs = keras.Input((240, 240, 144, 32))
    model = keras.Model(inputs, keras.layers.Conv3D(16, 3, padding="same", name="wide")(inputs))
    (check,) = check_model(model, family="jit:avx512_core")
    assert check.layer == "wide" and not check.gemm_fits and not check.reference


def test_parse_create_lines():
    line = (
        "onednn_verbose,v1,primitive,create:cache_miss,cpu,convolution,ref:any,backward_weights,"
        "src:f32::blocked:acdeb::f0 wei:f32:a:blocked:abcde::f0 bia:undef::undef::: dst:f32::blocked:acdeb::f0,,"
        "alg:convolution_direct,mb1_ic32oc16_id240od240kd3sd1dd0pd1_ih240oh240kh3sh1dh0ph1_iw144ow144kw3sw1dw0pw1,0.03"
    )
    assert _parse_create(line) == (
        "ref:any",
        "mb1_ic32oc16_id240od240kd3sd1dd0pd1_ih240oh240kh3sh1dh0ph1_iw144ow144kw3sw1dw0pw1",
    )
    assert _parse_create(line.replace("backward_weights", "backward_data")) is None
    assert _parse_create("onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src,,,4x4,3.3") is None
