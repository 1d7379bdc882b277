"""Decode steps start each layer on the device as soon as its graph is built, behind one switch.

A decode step (every segment one token) is a small graph per layer, and building it in Python costs
about as much as running it (docs/BENCHMARKS.md, "Issue 14, session 6: the host cost of a decode
step"). Built whole and then evaluated, the device idles while Python builds. With this switch on,
`DeepseekV4.run_layers` hands each layer's output streams and that layer's cache arrays to
`mx.async_eval` right after building it, so the device runs layer i while Python builds layer i + 1.
Only *when* arrays are evaluated changes, never what is computed: the same bits either way
(tests/equivalence/test_decode_async.py).

Off by default: on the H200 a per-layer `async_eval` made a batch-1 step slower, not faster (docs/BENCHMARKS.md,
"Session 6 on the H200 (issue 14): first lease"): MLX's CUDA backend encodes the kernels in the calling thread
before `async_eval` returns, so the host's encoding does not overlap the next layer's Python; only the
device's execution is asynchronous. The switch stays for measuring that again (docs/bench/issue14_decode_host.py).

Switch: the environment variable TESSERA_DECODE_ASYNC=1 turns it on (0, the default, off);
`set_decode_async_enabled` flips it in a running process (A B B A comparisons).
"""

from __future__ import annotations

from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_DECODE_ASYNC"
_switch = Switch(ENV_VAR, default=False)


def decode_async_enabled() -> bool:
    return _switch.enabled()


def set_decode_async_enabled(enabled: bool) -> None:
    """Turns the per-layer start of decode steps on or off (takes effect on the next step built)."""
    _switch.set(enabled)
