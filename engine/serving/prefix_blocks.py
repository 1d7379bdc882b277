"""Token blocks of the prefix cache and their chained hashes. No mlx import (the scheduler aligns its
prefill chunks to these blocks).

A prefix is cached at multiples of BLOCK_TOKENS tokens. Block k's key hashes the key of block k-1
together with block k's token ids (vLLM's scheme), so one key names the whole prefix before it; the
root key hashes the model's identity (config and compute dtype), so a key never matches another
model's state.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BLOCK_TOKENS = 128


def root_key(model_identity: str) -> bytes:
    return hashlib.sha256(b"tessera-prefix-v1\0" + model_identity.encode()).digest()


def chained_keys(token_ids: Sequence[int], parent: bytes, start: int, end: int, block: int = BLOCK_TOKENS) -> list[bytes]:
    """Keys of the blocks [start, end) of `token_ids` (both multiples of `block`), chained from `parent`,
    the key of the prefix token_ids[:start]. Entry j names the prefix token_ids[:start + (j+1)·block]."""
    if start % block or end % block or end > len(token_ids):
        raise ValueError(f"blocks [{start}, {end}) of {len(token_ids)} tokens are not whole blocks of {block}")
    keys, key = [], parent
    for lo in range(start, end, block):
        key = hashlib.sha256(key + array("q", token_ids[lo : lo + block]).tobytes()).digest()
        keys.append(key)
    return keys


def block_floor(num_tokens: int, block: int = BLOCK_TOKENS) -> int:
    return num_tokens // block * block


def aligned_chunk_end(start: int, end: int, prompt_end: int, block: int = BLOCK_TOKENS) -> int:
    """Where a prefill chunk [start, end) of a prompt of `prompt_end` tokens should end so the prefix
    cache can save it: a chunk stopping inside the prompt is cut back to a block boundary (unless
    that leaves it empty), and the chunk that would reach the prompt's end stops at its last block
    boundary first (the next turn's prompt starts with this one)."""
    if end < prompt_end:
        cut = block_floor(end, block)
        return cut if cut > start else end
    cut = block_floor(prompt_end, block)
    return cut if start < cut < prompt_end else end
