"""Decode steps start each layer on the device as soon as its graph is built, behind one switch.

A decode step (every segment one token) is a small graph per layer, and building it in Python costs
about as much as running it (docs/BENCHMARKS.md, "Issue 14, session 6: the host cost of a decode
step"). Built whole and then evaluated, the device idles while Python builds. With this switch on,
`DeepseekV4.run_layers` hands each layer's output streams and that layer's cache arrays to
`mx.async_eval` right after building it, so the device runs layer i while Python builds layer i + 1.
Only *when* arrays are evaluated changes, never what is computed: the same bits either way
(tests/equivalence/test_decode_async.py).

Switch: the environment variable TESSERA_DECODE_ASYNC=0 turns it off (1, the default, on);
`set_decode_async_enabled` flips it in a running process (A B B A comparisons,
docs/bench/issue14_decode_host.py).
"""

from __future__ import annotations

from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_DECODE_ASYNC"
_switch = Switch(ENV_VAR)


def decode_async_enabled() -> bool:
    return _switch.enabled()


def set_decode_async_enabled(enabled: bool) -> None:
    """Turns the per-layer start of decode steps on or off (takes effect on the next step built)."""
    _switch.set(enabled)
