"""oneDNN's real decision at the cliff: the filter-gradient kernel it creates just under and just over the
gemm scratchpad limit, on the AVX2 instruction set (``ONEDNN_MAX_CPU_ISA=AVX2``, so the check holds on
AVX-512 machines too), against the limit kernel_check predicts. Only primitives are created: the probe
kills its child as soon as the reference kernel is created (~1.5 GiB of zeros per shape, ~20 s)."""

import pytest

from bigmem_train.model.conv import ConvGeometry, gemm_backward_weights_fits, plan_depth_chunk, slab_geometry
from bigmem_train.model.kernel_check import GEMM_FAMILY, probe_backward_weights

pytestmark = pytest.mark.slow


def test_onednn_drops_gemm_exactly_where_the_limit_says_and_not_for_chunks():
    tile_layer = ConvGeometry((240, 240, 144), 32, 16)  # up0_conv1 of the study's tile
    below, above = ConvGeometry((215, 240, 144), 32, 16), ConvGeometry((216, 240, 144), 32, 16)
    chunk = slab_geometry(tile_layer, plan_depth_chunk(tile_layer))
    geometries = [below, above, tile_layer, chunk]
    created = probe_backward_weights(geometries, env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    implementations = [implementation for implementation, _ in created]
    assert implementations == [GEMM_FAMILY, "ref:any", "ref:any", GEMM_FAMILY]
    assert [gemm_backward_weights_fits(g) for g in geometries] == [True, False, False, True]
    assert created[1][1].startswith("mb1_ic32oc16_id216")
