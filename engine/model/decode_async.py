"""How a decode step's layers reach the device: all at once after the whole graph is built (off, the
default), each layer as soon as its graph is built (inline), or each layer handed to a second thread that
encodes it while this one builds the next (thread).

A decode step (every segment one token) is a small graph per layer, and on MLX's CUDA backend its host
time is two halves: Python building the graph and MLX encoding the kernels, which `mx.async_eval` does in
the calling thread before it returns (docs/BENCHMARKS.md, "Session 6 on the H200 (issue 14): first
lease"). So:
- inline: `DeepseekV4.run_layers` calls `mx.async_eval` on each layer's output streams and cache arrays
  right after building it. The device may start layer i while Python builds layer i + 1, but the
  encoding still runs between the two builds. On the H200 it made a batch-1 step slower (+15 to +26 %),
  not faster: kept for measuring.
- thread: the same layers go to an `EncodeThread` (encode_thread.py), which encodes layer i while this
  thread builds layer i + 1, so that the two halves of the host time would overlap. `DeepseekV4.forward`
  decides per step whether it applies (decode steps whose graph building reads nothing from the device)
  and drains the thread before it returns. On the H200 they did not overlap: with the thread running,
  building took about as long as building and encoding had taken together, and a step was no faster
  (docs/BENCHMARKS.md, "Session 12 on the H200"). Session 28 (H100) found why: MLX's own work slows on
  both threads at once (a build of MLX ops 1.4–1.8× longer during an encode, the encode up to 1.7× longer during
  compiled replays), not the GIL. The thread took 1.3–1.5 ms off a step whose build and encode ran one after
  the other (6.4 ms), but the serving step, whose device already runs under the next step's build, was
  0.3–0.9 ms slower with it. Kept for measuring, like inline.

Only *when* arrays are evaluated changes, never what is computed: the same bits in every mode
(tests/equivalence/test_decode_async.py).

Switch: the environment variable TESSERA_DECODE_ASYNC=0|1|thread (0, the default, off; 1 inline);
`set_decode_async_mode` changes it in a running process (A B B A comparisons).
"""

from __future__ import annotations

import os
from typing import Literal

ENV_VAR = "TESSERA_DECODE_ASYNC"
Mode = Literal["off", "inline", "thread"]
_FROM_ENV: dict[str, Mode] = {"0": "off", "1": "inline", "thread": "thread"}


def _mode_from_env() -> Mode:
    value = os.environ.get(ENV_VAR, "0")
    if value not in _FROM_ENV:
        raise ValueError(f"{ENV_VAR} must be 0 (off), 1 (inline) or thread, got {value!r}")
    return _FROM_ENV[value]


_mode: Mode = _mode_from_env()


def decode_async_mode() -> Mode:
    return _mode


def set_decode_async_mode(mode: Mode) -> None:
    """Takes effect on the next step built."""
    global _mode
    if mode not in _FROM_ENV.values():
        raise ValueError(f"decode async mode must be one of {sorted(_FROM_ENV.values())}, got {mode!r}")
    _mode = mode


def decode_async_enabled() -> bool:
    """Whether a decode step's layers start before the whole step is built (inline or thread)."""
    return _mode != "off"


def set_decode_async_enabled(enabled: bool) -> None:
    """On: inline (the per-layer start in this thread); off: the whole step at once."""
    set_decode_async_mode("inline" if enabled else "off")
