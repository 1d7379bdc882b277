"""Prefix cache: the state of sequences at block boundaries, so a prompt that starts with a cached
prefix restores it and prefills only the rest (a conversation's next turn pays for its new tokens).

What V4 needs to continue a sequence after n tokens (engine/model/cache.py): the compressed rows
and index keys of every layer — append-only, so "the first rows" of a longer sequence — plus the
window and compressor frontier at exactly n (`ResumeState`). The cache is a tree of nodes: a node
holds the rows its sequence appended since its parent node and the resume state at its end; its key
is the chained hash of the prefix's blocks (engine/serving/prefix_blocks.py). Nodes are made where a
running sequence's cache ends on a block boundary (a prefill chunk end, or a decode step; the
scheduler aligns chunk ends to blocks), so a prompt resumes at the longest cached node end.

The cache's arrays are read-only: a restore copies the rows into the request's own buffers (it
appends to them at once) and shares the window and frontier (the model replaces those, never
writes into them), so any number of requests can start from one node at once.
LRU eviction under `capacity_bytes`. A node is always used at least as recently as its children
(using a node touches its ancestors after it), so the least recent node is a leaf and eviction
never strands a child; a node whose ancestor is gone is evicted with it anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

from tessera.engine.model.cache import LayerRows, ResumeState, SequenceCache, detached, restored_cache, resume_state, rows_between
from tessera.engine.model.config import ModelConfig
from tessera.engine.serving.prefix_blocks import BLOCK_TOKENS, block_floor, chained_keys, root_key


@dataclass(eq=False)
class PrefixNode:
    key: bytes  # chained hash of tokens [0, num_tokens)
    parent: PrefixNode | None
    rows: tuple[LayerRows, ...]  # rows appended over tokens [parent.num_tokens, num_tokens)
    state: ResumeState
    nbytes: int
    last_used: int = 0
    is_alive: bool = True
    children: list[PrefixNode] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.state.num_tokens

    def chain(self) -> list[PrefixNode]:
        """Root-first path to this node."""
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass
class Lineage:
    """Where one running sequence stands with the cache: the node its cache was last saved at (None:
    nothing saved yet) and a decode-boundary state saved when the sequence ends."""

    node: PrefixNode | None = None
    pending: ResumeState | None = None


@dataclass(frozen=True)
class PrefixCacheStats:
    queries_tokens: int  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hit_tokens: int  # of those, tokens restored from the cache (vLLM's prefix_cache_hits)
    nbytes: int
    num_nodes: int
    num_evicted_nodes: int


class PrefixCache:
    def __init__(
        self, cfg: ModelConfig, dtype: mx.Dtype, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.cfg, self.dtype, self.capacity_bytes, self.block_tokens = cfg, dtype, capacity_bytes, block_tokens
        self._root = root_key(f"{cfg!r}|{dtype}")
        self._nodes: dict[bytes, PrefixNode] = {}
        self._clock = 0
        self._nbytes = 0
        self._queries = self._hits = self._evicted = 0

    # ---- lookup and restore --------------------------------------------------------------------

    def longest_prefix(self, prompt_ids: Sequence[int]) -> PrefixNode | None:
        """The cached node covering the most leading tokens of the prompt, leaving at least one token
        to prefill (its logits give the first output token). Counts no query: see `restore`."""
        end = block_floor(len(prompt_ids) - 1, self.block_tokens)
        if end <= 0 or not self._nodes:
            return None
        keys = chained_keys(prompt_ids, self._root, 0, end, self.block_tokens)
        for key in reversed(keys):
            node = self._nodes.get(key)
            if node is not None:
                return node
        return None

    def count_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self._queries += num_prompt_tokens
        self._hits += num_hit_tokens

    def restore(self, node: PrefixNode, token_ids: Sequence[int]) -> SequenceCache:
        """A new cache equal to the one `node` was saved from (token_ids: the prompt, whose first
        node.num_tokens tokens are the node's prefix)."""
        if not node.is_alive:
            raise ValueError("the prefix node was evicted")
        chain = node.chain()
        self._touch(node)
        return restored_cache(self.cfg, self.dtype, [n.rows for n in chain], node.state, list(token_ids))

    # ---- saving --------------------------------------------------------------------------------

    def save(self, cache: SequenceCache, lineage: Lineage, state: ResumeState | None = None) -> None:
        """Save `cache` as it was at `state` (default: now), which must end on a block boundary.
        Reuses an existing node for the same prefix; stores only the rows since the lineage's node."""
        state = detached(state or resume_state(cache))  # its own rows, not a batched step's arrays
        if state.num_tokens % self.block_tokens or state.num_tokens == 0:
            raise ValueError(f"a saved state must end on a block boundary, not at {state.num_tokens} tokens")
        parent = lineage.node if lineage.node is not None and lineage.node.is_alive else None
        start = parent.num_tokens if parent else 0
        if start >= state.num_tokens:
            return
        parent_key = parent.key if parent else self._root
        key = chained_keys(cache.token_ids, parent_key, start, state.num_tokens, self.block_tokens)[-1]
        existing = self._nodes.get(key)
        if existing is not None:
            lineage.node = existing
            self._touch(existing)
            return
        rows = rows_between(cache, parent.state if parent else None, state)
        nbytes = sum(r.nbytes for r in rows) + state.nbytes
        if nbytes > self.capacity_bytes:
            return  # could never fit; the lineage keeps its older node
        # Cut the row copies loose from the live buffers now, and make sure the window and frontier are no
        # lazy slices of the step's chunk-wide arrays (which they would keep alive).
        mx.eval(*[a for r in rows for a in r.arrays()], *state.arrays())
        node = PrefixNode(key, parent, rows, state, nbytes)
        if parent is not None:
            parent.children.append(node)
        self._nodes[key] = node
        self._nbytes += nbytes
        self._touch(node)
        lineage.node = node
        self._evict_to(self.capacity_bytes)

    # ---- memory --------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits, self._nbytes, len(self._nodes), self._evicted)

    def _touch(self, node: PrefixNode) -> None:
        # Ancestors after the node: a parent is never less recent than its child.
        for n in reversed(node.chain()):
            self._clock += 1
            n.last_used = self._clock

    def _evict_to(self, limit: int) -> None:
        while self._nbytes > limit and self._nodes:
            victim = min(self._nodes.values(), key=lambda n: n.last_used)
            self._drop(victim)

    def _drop(self, node: PrefixNode) -> None:
        for child in list(node.children):
            self._drop(child)
        node.is_alive = False
        node.rows, node.state = (), ResumeState(node.state.num_tokens, ())  # a lineage may still point here
        del self._nodes[node.key]
        self._nbytes -= node.nbytes
        self._evicted += 1
        if node.parent is not None and node.parent.is_alive:
            node.parent.children.remove(node)
