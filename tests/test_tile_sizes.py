"""Tile sizes by layer (engine/tiling.py): the configured tile T bounds the tile scratch at the
widest layer; narrower layers take more rows without going over it."""

from __future__ import annotations

import pytest

from engine.config import CSA, HCA, WINDOW
from engine.make_model import preset_config
from engine.memory_plan import layer_tile_bytes
from engine.tiling import MAX_TILE_ELEMENTS, largest_tile_array, layer_tiles

FLASH = preset_config("flash-attn")  # V4 Flash attention shapes: window, CSA, HCA, CSA


def test_at_1m_context_hca_keeps_t_while_csa_and_window_take_more_rows():
    # HCA's logits over 8,192 compressed rows for 64 heads make it the widest layer at 1M.
    assert layer_tiles(FLASH, 1048576, 4096, 1024, 2) == {HCA: 1024, CSA: 2048, WINDOW: 4096}


def test_early_in_the_context_csa_is_the_widest_and_keeps_t():
    tiles = layer_tiles(FLASH, 8192, 4096, 1024, 2)
    assert tiles[CSA] == 1024 and tiles[HCA] > 1024 and tiles[WINDOW] > 1024


@pytest.mark.parametrize("ctx", [4096, 65536, 262144, 1048576, 4194304])
@pytest.mark.parametrize("chunk,tile", [(4096, 1024), (4096, 2048), (8192, 512), (4096, 1000)])
def test_no_layer_goes_over_the_scratch_t_rows_need_at_the_widest_layer(ctx, chunk, tile):
    tiles = layer_tiles(FLASH, ctx, chunk, tile, 2)
    budget = max(layer_tile_bytes(FLASH, kind, ctx, tile, 2) for kind in tiles)
    for kind, rows in tiles.items():
        assert tile <= rows <= chunk
        assert layer_tile_bytes(FLASH, kind, ctx, rows, 2) <= budget
        if rows > tile:  # T itself is the user's choice (ModelRunner refuses one too large for the GPU)
            assert largest_tile_array(FLASH, kind, ctx, rows) <= MAX_TILE_ELEMENTS
    assert min(tiles.values()) == tile  # the widest layer gets exactly T


def test_a_scaled_tile_stays_within_32_bit_indexing():
    # At 4M context a 2048-row CSA tile would fit the HCA budget but its scores would have
    # 2048 × 1,048,576 elements, more than MLX's CUDA kernels index.
    tiles = layer_tiles(FLASH, 4194304, 8192, 1024, 2)
    assert largest_tile_array(FLASH, CSA, 4194304, tiles[CSA]) <= MAX_TILE_ELEMENTS < 2048 * 4194304 // 4


def test_larger_tiles_are_split_evenly():
    # CSA may take ~1,500 rows at 256k context here: three tiles of 1366, not 1500 + 1500 + 1096.
    tiles = layer_tiles(FLASH, 262144, 4096, 1024, 2)
    assert tiles[CSA] == 1366


def test_fixed_tiling_and_short_segments():
    assert layer_tiles(FLASH, 1048576, 4096, 1024, 2, scale=False) == {HCA: 1024, CSA: 1024, WINDOW: 1024}
    assert layer_tiles(FLASH, 1048576, 1, 1024, 2) == {HCA: 1, CSA: 1, WINDOW: 1}  # a decode token
    assert layer_tiles(FLASH, 1048576, 600, 1024, 2) == {HCA: 600, CSA: 600, WINDOW: 600}
