"""The fused experts' tile rules (pure Python: no Triton, no GPU)."""

from __future__ import annotations

import pytest

from dbo.experts.kernels.fused_tiles import (
    FLAT_DOWN,
    FUSED_MAX_INTERMEDIATE,
    FUSED_MAX_LOCAL_EXPERTS,
    FUSED_MAX_ROWS_PER_EXPERT,
    GemmConfig,
    pick_configs,
    prefer_fused,
)


def test_fused_everywhere_but_many_experts_with_many_rows_and_a_wide_intermediate():
    many = FUSED_MAX_LOCAL_EXPERTS + 1
    wide = FUSED_MAX_INTERMEDIATE * 2
    assert prefer_fused(4096, 1024, many)  # I <= 2048: any size
    assert prefer_fused(4096, FUSED_MAX_INTERMEDIATE, many)
    assert prefer_fused(FUSED_MAX_ROWS_PER_EXPERT, wide, many)
    assert not prefer_fused(FUSED_MAX_ROWS_PER_EXPERT + 1, wide, many)
    assert prefer_fused(4096, wide, FUSED_MAX_LOCAL_EXPERTS)  # few experts: fused at any size
    assert not prefer_fused(4096, wide)  # unknown: as if many


def test_a_tile_may_carry_its_own_persistence():
    assert GemmConfig(persistent=True).persistent is True
    assert GemmConfig().persistent is None  # the call's policy
    with pytest.raises(ValueError, match="persistent always"):
        GemmConfig(128, 128, 64, 8, 4, 3, flat=True, persistent=False)
    with pytest.raises(ValueError, match="tail_m"):
        GemmConfig(64, 64, 64, tail_m=24)


@pytest.mark.parametrize("kw", [dict(block_m=32), dict(block_m=128, tail_m=32), dict(flat=True),
                                dict(n_per_program=4)])
def test_a_warp_specialized_tile_is_a_gate_up_tile_of_64_or_128_rows(kw):
    GemmConfig(128, 128, 64, ws=True)
    GemmConfig(64, 128, 64, ws=True)
    with pytest.raises(ValueError, match="warp-specialized"):
        GemmConfig(**{"block_m": 128, "block_n": 128, **kw, "ws": True})


@pytest.mark.parametrize("kw", [dict(split=1), dict(split=-2), dict(split=4, ws=False)])
def test_split_is_two_or_more_shares_of_a_warp_specialized_tile(kw):
    tile = GemmConfig(64, 128, 64, ws=True, split=4)
    assert tile.triton_tile().split == 0  # the Triton kernel does not split
    with pytest.raises(ValueError, match="split"):
        GemmConfig(**{"block_m": 64, "block_n": 128, "ws": True, **kw})


def test_few_experts_at_short_intermediates_split_the_last_round():
    from dbo.experts.kernels.fused_tiles import WS_UP64_SPLIT

    assert pick_configs(259, 256, 32)[0] == WS_UP64_SPLIT
    assert pick_configs(1024, 256, 32)[0] == WS_UP64_SPLIT
    assert pick_configs(2048, 256, 32)[0].split == 0  # the 128-row tile fills its rounds
    assert all(pick_configs(r, i, n)[0].split == 0 for r in (256, 512) for i, n in ((256, 128), (768, 32)))


@pytest.mark.parametrize("inter", [256, 768, 2048])
@pytest.mark.parametrize("n_local", [32, 128, 256])
def test_one_tile_of_rows_per_expert_takes_the_split_128_row_tile(inter, n_local):
    from dbo.experts.kernels.fused_tiles import WS_UP_SPLIT

    assert pick_configs(128, inter, n_local)[0] == WS_UP_SPLIT
    assert pick_configs(192, inter, n_local)[0] == WS_UP_SPLIT
    assert not pick_configs(96, inter, n_local)[0].ws
    assert pick_configs(128, 320, n_local)[0].ws is False  # I not a multiple of the ws tile's columns
    assert WS_UP_SPLIT.triton_tile().tail_m == 32  # off Hopper: the Triton tile with tails it replaced


@pytest.mark.parametrize("n_local", [8, 32, 64])
def test_few_experts_at_wide_intermediates_on_slabs_take_the_split_64_row_tile(n_local):
    from dbo.experts.kernels.fused_tiles import FLAT_DOWN_64, WS_UP64_SPLIT, pick_slab_configs

    for rows in (97, 129, 257, 384):
        assert pick_slab_configs(rows, 2048, n_local) == (WS_UP64_SPLIT, FLAT_DOWN_64)
        assert pick_configs(rows, 2048, n_local) != (WS_UP64_SPLIT, FLAT_DOWN_64)  # STANDARD's rule
    assert pick_slab_configs(513, 2048, n_local) == (WS_UP64_SPLIT, FLAT_DOWN)
    assert pick_slab_configs(1024, 4096, n_local)[0] == WS_UP64_SPLIT
    # elsewhere the slabs take STANDARD's tiles: as many experts, fewer or more rows, a narrower
    # or misaligned intermediate
    for rows, inter, n in ((257, 2048, 128), (96, 2048, n_local), (2048, 2048, n_local),
                           (257, 768, n_local), (257, 2112, n_local), (64, 256, n_local)):
        assert pick_slab_configs(rows, inter, n) == pick_configs(rows, inter, n)


def test_a_fallback_tile_is_the_triton_tile_of_a_ws_tile():
    triton_tile = GemmConfig(128, 128, 64, 8, 8, 4, tma=True, tail_m=32)
    assert GemmConfig(128, 128, 64, ws=True, fallback=triton_tile).triton_tile() is triton_tile
    assert GemmConfig(128, 128, 64, ws=True).triton_tile().ws is False  # the same blocks
    with pytest.raises(ValueError, match="fallback"):
        GemmConfig(128, 128, 64, fallback=triton_tile)
    with pytest.raises(ValueError, match="fallback"):
        GemmConfig(128, 128, 64, ws=True, fallback=GemmConfig(64, 128, 64, ws=True))


def test_operands_off_a_hopper_gpu_take_the_triton_kernel():
    import torch

    from dbo.experts.kernels.fused_experts import runs_ws

    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert not runs_ws(GemmConfig(128, 128, 64, ws=True), x, torch.zeros(2, 256, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 1 << 20])
@pytest.mark.parametrize("inter", [128, 256, 768, 2048])
@pytest.mark.parametrize("n_local", [8, 32, 128, 256])
def test_every_size_gets_a_valid_pair_of_tiles(rows, inter, n_local):
    up, down = pick_configs(rows, inter, n_local)
    assert not up.flat and not up.n_per_program  # those are down tiles
    if down.n_per_program:
        assert inter <= down.block_k  # a short-K tile holds the whole K
    assert down.flat or down.block_m in (64, 128)
