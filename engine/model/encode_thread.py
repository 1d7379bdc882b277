"""A thread that hands a decode step's layers to the device (MLX's encoding of their kernels) while the
calling thread builds the next layer's graph in Python.

Why a thread: a decode step on MLX's CUDA backend is host-bound, and its host time has two halves that
ran one after the other — Python building the graph (~2 ms for flash-width's 4 layers) and MLX encoding
its ~740 primitives into CUDA graphs (~3.5 ms; `mx.async_eval` does it in the calling thread before it
returns; docs/BENCHMARKS.md, "Session 6 on the H200 (issue 14): first lease"). `mx.async_eval` releases
Python's GIL while it encodes, so a second thread can encode layer i while the first builds layer i + 1.

What MLX requires, and how this meets it:
- MLX's CUDA streams belong to the thread that made them (a thread-local command encoder); a graph built
  on one thread's stream cannot be encoded by another. The graphs handed over are therefore built on
  `stream`, made by `mx.new_thread_unsafe_stream`: one command encoder any thread may use, but only one
  thread at a time. The owner (`DeepseekV4.forward`) builds under `mx.stream(stream)` and calls `drain`
  before anything else evaluates: between `submit` and `drain` the calling thread only builds graphs.
- Building a graph on arrays another thread is evaluating reads only their shapes and takes references;
  MLX keeps an array's inputs alive while it evaluates it, so nothing is freed under either thread.
- Python's GIL: the thread needs it for a moment around each `mx.async_eval` call. The builder holds it
  while it builds, and by default hands it over only every 5 ms (`sys.getswitchinterval`), longer than a
  layer takes; `start` lowers the interval to `SWITCH_INTERVAL_S` for the process.

Only *when* a layer is encoded changes, never what is computed: same graph, same kernels, same bits
(tests/equivalence/test_decode_async.py runs it against steps evaluated whole).
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Sequence

import mlx.core as mx

# How long the builder may hold the GIL while the encode thread waits for it: well below a layer's
# encoding (~0.9 ms at flash widths), so a finished encode starts the next one without waiting a layer.
SWITCH_INTERVAL_S = 50e-6


class EncodeThread:
    """One daemon thread evaluating (`mx.async_eval`) what `submit` hands it, in order, on `stream`."""

    def __init__(self, device: mx.Device) -> None:
        self.stream = mx.new_thread_unsafe_stream(device)
        self._queue: queue.SimpleQueue[Sequence[mx.array]] = queue.SimpleQueue()
        self._state = threading.Condition()
        self._submitted = 0
        self._encoded = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tessera-encode", daemon=True)
        self._thread.start()

    def submit(self, arrays: Sequence[mx.array]) -> None:
        """Queues `arrays` (built on `stream`) for evaluation; returns at once."""
        with self._state:
            self._submitted += 1
        self._queue.put(list(arrays))

    def drain(self) -> None:
        """Returns once everything submitted is encoded (queued on the device, not necessarily run); an
        error the thread met while encoding is raised here, in the caller's thread."""
        with self._state:
            self._state.wait_for(lambda: self._encoded == self._submitted)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            arrays = self._queue.get()
            error = None
            try:
                mx.async_eval(*arrays)  # releases the GIL while MLX encodes
            except BaseException as e:  # handed to the builder's thread by `drain`
                error = e
            del arrays
            with self._state:
                self._error = self._error or error
                self._encoded += 1
                self._state.notify_all()


_threads: dict[str, EncodeThread] = {}
_lock = threading.Lock()


def encode_thread(device: mx.Device) -> EncodeThread:
    """The process's encode thread for `device`, started on first use (and with it the shorter GIL
    switch interval: module docstring)."""
    key = str(device)
    with _lock:
        if key not in _threads:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            _threads[key] = EncodeThread(device)
        return _threads[key]
