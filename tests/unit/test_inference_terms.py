"""The inference plan's terms against hand-computed answers (memory/inference.py, infer/engine.py).

Mutation testing left these standing (docs/results/mutation-testing.md): the live set of a forward pass
where one tensor has two readers, how tiles are halved toward a fit, tile starts, an edge the levels do not
divide, the INT8 quantization's planned peak, and which CPU flags make a precision native. Every expected
value below is worked out by hand in the comment beside it (the flag names are Linux's /proc/cpuinfo
names), not taken from the code under test.
"""

from __future__ import annotations

import pytest

from bigmem_train.config import load_config
from bigmem_train.errors import BadInput
from bigmem_train.infer.engine import check_precision, native_precisions
from bigmem_train.memory.inference import (
    _elements,
    _tile_candidates,
    forward_live_bytes,
    padded_shape,
    parameter_bytes,
    quantization_peak_bytes,
    tile_starts,
)
from tests.fixtures.layer_records import layer_row

# A two-level U-Net in miniature: `a` is read by the pooling and, later, by the skip's concatenation.
SKIP_TABLE = [
    layer_row("in", "InputLayer", [], 1, 1),
    layer_row("a", "Conv3D", ["in"], 1, 2, (3, 3, 3), params=56),  # 3x3x3x1x2 kernel + 2 biases
    layer_row("b", "MaxPooling3D", ["a"], 2, 2),
    layer_row("c", "UpSampling3D", ["b"], 1, 2),
    layer_row("d", "Concatenate", ["c", "a"], 1, 4),
    layer_row("out", "Conv3D", ["d"], 1, 1, (1, 1, 1), params=5),  # 1x1x1x4x1 kernel + 1 bias
]


def test_a_tensor_with_two_readers_stays_alive_until_its_last_reader():
    # Window 4x4x4 = 64 voxels, float32. Outputs: in 256 B, a 512, b (8 voxels x 2) 64, c 512, d 1024,
    # out 256. Walking the rows: in+a = 768 (in freed); a+b = 576 (a still has the concatenation to feed);
    # a+b+c = 1088 (b freed); a+c+d = 2048, the peak; then d+out = 1280. Freeing `a` after its first
    # reader would give 1536 at `d` (c+d) and a peak of 1536.
    assert forward_live_bytes(SKIP_TABLE, (4, 4, 4), batch_norm=False) == 2048


def test_a_bfloat16_output_counts_two_bytes_a_value():
    table = [
        layer_row("in", "InputLayer", [], 1, 1),
        layer_row("a", "Conv3D", ["in"], 1, 2, dtype="bfloat16"),
    ]
    # in 64 x 4 = 256 B beside a: 64 x 2 channels x 2 B = 256 B.
    assert forward_live_bytes(table, (4, 4, 4), batch_norm=False) == 512


def test_an_edge_the_levels_do_not_divide_is_floored_at_each_level():
    # 18 // 4 = 4 on each axis: 64 positions x 3 channels (a true division would give 4.5**3 x 3).
    assert _elements(layer_row("x", "Conv3D", [], 4, 3), (18, 18, 18)) == 192
    assert _elements(layer_row("x", "Conv3D", [], 1, 3), (18, 17, 5)) == 18 * 17 * 5 * 3


def test_the_quantization_peak_adds_the_crops_a_forward_pass_and_two_copies_of_the_weights():
    config = load_config(
        None,
        {
            "data.input_shape": [4, 4, 4],
            "data.channels": [0],
            "model.depth": 1,
            "model.batch_norm": False,
        },
    )
    assert parameter_bytes(SKIP_TABLE) == 4 * (56 + 5)  # 244 B of float32 weights
    # The conversion's envelope: its child's baseline plus 5 bytes a weight byte, beside OpenVINO's own
    # baseline (the fitted constants, docs/results/predict-memory.md).
    conversion = int(0.64 * 2**30) + 5 * 244 + int(0.156 * 2**30)
    crops = 32 * 64 * 1 * 4  # 32 crops of 4x4x4, one channel, float32: 8192 B
    forward = int(0.915 * 2048)  # OpenVINO's factor on the live set worked out above
    weights = 2 * 244  # NNCF's clone and the quantized model
    assert quantization_peak_bytes(config, SKIP_TABLE, crops=32) == conversion + crops + forward + weights
    # Each crop is one more crop's bytes; no crop leaves the rest.
    assert (
        quantization_peak_bytes(config, SKIP_TABLE, crops=33)
        - quantization_peak_bytes(config, SKIP_TABLE, 32)
        == 256
    )
    assert quantization_peak_bytes(config, SKIP_TABLE, crops=0) == conversion + forward + weights


def test_the_quantization_plan_reads_the_models_input_channels():
    one = load_config(None, {"data.input_shape": [4, 4, 4], "data.channels": [0], "model.depth": 1})
    four = load_config(None, {"data.input_shape": [4, 4, 4], "data.channels": "all", "model.depth": 1})
    # Three more channels: 32 crops x 64 voxels x 3 x 4 B more.
    assert quantization_peak_bytes(four, SKIP_TABLE) - quantization_peak_bytes(one, SKIP_TABLE) == 24576


def test_tiles_are_halved_longest_edge_first_in_steps_the_levels_divide():
    # BraTS padded for depth 4 (step 16, smallest tile 32): the longest edge halved and rounded up to a
    # multiple of 16 each time (240 -> 128, 160 -> 80, 80 -> 48, 48 -> 32), the first of equal edges first.
    assert _tile_candidates((240, 240, 160), 4) == [
        (128, 240, 160),
        (128, 128, 160),
        (128, 128, 80),
        (64, 128, 80),
        (64, 64, 80),
        (64, 64, 48),
        (32, 64, 48),
        (32, 32, 48),
        (32, 32, 32),
    ]
    # Depth 2 (step 4, smallest 8): 20 -> 12 (10 up to 12) -> 8 (6 up to 8, not below the smallest).
    assert _tile_candidates((20, 8, 8), 2) == [(12, 8, 8), (8, 8, 8)]
    assert _tile_candidates((8, 8, 8), 2) == []


def test_tile_starts_cover_the_edge_with_half_tile_overlaps():
    # 100 voxels, tiles of 32: ceil(68 / 16) + 1 = 6 tiles, 13.6 apart, rounded.
    assert tile_starts(100, 32) == [0, 14, 27, 41, 54, 68]
    assert tile_starts(48, 32) == [0, 16]
    assert tile_starts(32, 32) == [0]
    assert tile_starts(20, 32) == [0]


def test_edges_are_padded_to_what_the_poolings_divide():
    assert padded_shape((240, 240, 155), 4) == (240, 240, 160)
    assert padded_shape((33, 1, 16), 3) == (40, 8, 16)


@pytest.mark.parametrize(
    ("cpu", "flags", "native"),
    [
        # Sapphire Rapids: AMX (bf16, int8) and AVX-512 BF16/VNNI.
        (
            "sapphire rapids",
            {"amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni"},
            ["int8", "bfloat16"],
        ),
        ("zen 4", {"avx512f", "avx512_bf16", "avx512_vnni"}, ["int8", "bfloat16"]),
        ("cooper lake without vnni (hypothetical)", {"avx512f", "avx512_bf16"}, ["bfloat16"]),
        ("ice lake", {"avx512f", "avx512_vnni"}, ["int8"]),
        ("alder lake", {"avx2", "avx_vnni"}, ["int8"]),
        ("amx alone", {"amx_bf16"}, ["bfloat16"]),
        ("amx int8 alone", {"amx_int8"}, ["int8"]),
        ("zen 2", {"avx2", "fma"}, []),
        ("unknown", None, []),
    ],
)
def test_native_precisions_follow_the_cpu_flags(cpu, flags, native):
    assert native_precisions(flags) == native, cpu
    if "bfloat16" in native:
        check_precision("bfloat16", flags)
    else:
        with pytest.raises(BadInput, match="no native bfloat16"):
            check_precision("bfloat16", flags)
    check_precision("float32", flags)  # native everywhere
    check_precision("auto", flags)


def test_an_unknown_precision_is_refused_by_name():
    with pytest.raises(BadInput, match="--precision float16: use one of auto, float32, bfloat16, int8"):
        check_precision("float16", {"amx_bf16"})
