"""The small index arrays a decode step makes from host values (positions, open slots, row counts), kept by
content, so a step whose values an earlier step had takes that step's array instead of making another.

Why (docs/ARCHITECTURE.md, "Host-made arrays"; read in MLX's allocator, not yet timed on a GPU): on CUDA,
MLX 0.32 puts an array made from host data in unified memory, and its allocator keeps one cache of freed
buffers for unified and device memory alike. An array of more than 8 bytes (a batch of 16 int32 positions
is 64) that is handed a cached device buffer of its size moves it to unified memory first: a
`cudaMallocManaged`, a synchronous `cudaMemcpy` and a free, on the host, in the middle of building the step.
A batch-1 step's arrays (4 or 8 bytes) come from a pool of their own and never pay it. A decode step makes
the same few arrays again and again: a sequence's open compressor slot repeats every `ratio` steps, the row
counts and closing windows' positions are the same for every layer of one ratio, top-k's k never changes.

The cached arrays are shared: no caller may write into one (`a[i] = …`); every caller here passes them
to ops as inputs. The cache is bounded (least recently used out) and guarded by a lock, for steps built
on more than one thread.

Switch: TESSERA_HOST_ARRAY_CACHE=0 makes every array anew (1, the default: the cache), for A B B A
comparisons on a GPU (docs/bench/issue14_decode_overlap.py's serving_overlap_no_host_array_cache arm).
The same values either way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tessera.kernels.switch import Switch

# ~250 steps of a steady batch-16 decode's new arrays (~4 a step; each a few hundred bytes at most): enough to
# keep an HCA compressor's open slots, whose values repeat every 128 steps (its ratio).
MAX_ENTRIES = 1024

_NUMPY_DTYPES = {mx.int32: np.int32, mx.uint32: np.uint32, mx.int64: np.int64, mx.bool_: np.bool_, mx.float32: np.float32}


def _host_values(values, dtype: mx.Dtype) -> np.ndarray:
    """The values as one contiguous NumPy array of `dtype`'s element type (what `mx.array` copies from)."""
    return np.ascontiguousarray(values, dtype=_NUMPY_DTYPES[dtype])


@dataclass(frozen=True)
class HostArrayStats:
    """How many arrays `host_array` handed out from the cache (hits) and made anew (made)."""

    hits: int
    made: int


class HostArrays:
    """Arrays made from host values, kept by dtype, shape and values: at most `max_entries`, the least
    recently used out. Thread-safe (steps may be built on the encode thread or another engine's)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._arrays: OrderedDict[tuple, mx.array] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._made = 0

    def get(self, values, dtype: mx.Dtype = mx.int32) -> mx.array:
        """`mx.array(values, dtype)` for a small array of host values (a list, nested lists or a NumPy
        array): the same array object for the same dtype, shape and values."""
        host = _host_values(values, dtype)
        key = (host.dtype.str, host.shape, host.tobytes())
        with self._lock:
            found = self._arrays.get(key)
            if found is not None:
                self._arrays.move_to_end(key)
                self._hits += 1
                return found
            made = mx.array(host)
            self._arrays[key] = made
            while len(self._arrays) > self.max_entries:
                self._arrays.popitem(last=False)
            self._made += 1
            return made

    def stats(self) -> HostArrayStats:
        with self._lock:
            return HostArrayStats(self._hits, self._made)


_shared = HostArrays()  # the process's: what every decode step takes its index arrays from
_switch = Switch("TESSERA_HOST_ARRAY_CACHE")


def cache_enabled() -> bool:
    return _switch.enabled()


def set_cache_enabled(enabled: bool) -> None:
    _switch.set(enabled)


def host_array(values, dtype: mx.Dtype = mx.int32) -> mx.array:
    """The process's `HostArrays.get` (a new `mx.array` each call with the cache switched off)."""
    if not _switch.enabled():
        return mx.array(_host_values(values, dtype))
    return _shared.get(values, dtype)


def stats() -> HostArrayStats:
    return _shared.stats()
