"""`mx.compile` for the model's and the kernels' references' small pure functions, behind one switch.

A decode step is a few thousand tiny ops (docs/BENCHMARKS.md, "Issue 14: decode overhead"): on a GPU
each one is a kernel launch plus host bookkeeping, so the step is bound by the op count, not by bytes.
Compiling a pure function fuses its elementwise ops into one kernel and replays its graph without
re-running the Python that built it.

Every function compiled here is compiled `shapeless`, so a prefill chunk of any length and a decode
batch of any size reuse one trace (no recompiles). Shapeless tracing is only correct for functions
without `Slice` (MLX refuses them) and without `reshape` (MLX silently keeps the traced shape): such
ops stay outside, in the caller. Compiled and plain runs give the same bits on the CPU
(tests/test_compiled.py); every compared path (batched/single, tiled/untiled, chunked/whole) runs the
same compiled functions either way. It lives in kernels/, the lowest layer that uses it (the kernels'
plain-MLX references are compiled too), so that kernels/ imports nothing of the engine.

A function that sums over an axis names it (`shapeless(sums_over=(argument, axis))`): where that
axis has size 1 the function runs plain, because MLX 0.32.4's shapeless compile segfaults on a sum
over an axis of size 1 (a top-1 MoE's slots; the same ops, the same bits on the CPU).

Switch: the environment variable TESSERA_COMPILE=0 turns compilation off (1, the default, on);
`set_compile_enabled` flips it in a running process (bench A B B A comparisons).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from tessera.kernels.switch import Switch

ENV_VAR = "TESSERA_COMPILE"
_switch = Switch(ENV_VAR)


def compile_enabled() -> bool:
    return _switch.enabled()


def set_compile_enabled(enabled: bool) -> None:
    """Turns the compiled paths on or off for every later call (takes effect on the next graph built)."""
    _switch.set(enabled)


class ShapelessCompiled:
    """`fn` compiled shapeless when compilation is on, `fn` itself when it is off or when the axis it
    sums over (`sums_over`: argument index, axis) has size 1."""

    def __init__(self, fn: Callable, sums_over: tuple[int, int] | None = None) -> None:
        self.plain = fn
        self.compiled = mx.compile(fn, shapeless=True)
        self.sums_over = sums_over

    def __call__(self, *args):
        return (self.compiled if _switch.enabled() and not self._sums_one_term(args) else self.plain)(*args)

    def _sums_one_term(self, args) -> bool:
        if self.sums_over is None:
            return False
        argument, axis = self.sums_over
        return args[argument].shape[axis] == 1


def shapeless(fn: Callable | None = None, *, sums_over: tuple[int, int] | None = None):
    """Decorator, bare or with `sums_over`: see ShapelessCompiled (fn must be pure, without Slice or reshape)."""
    if fn is None:
        return lambda f: ShapelessCompiled(f, sums_over)
    return ShapelessCompiled(fn)
