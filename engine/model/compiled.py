"""Fixed-shape `mx.compile` of a decode step's shape-stable parts, behind its own switch (the model's
small pure functions are compiled shapeless by kernels/shapeless.py, behind TESSERA_COMPILE).

The shape-stable parts of a decode step (engine/model/deepseek_v4.py: a layer's attention prologue,
its FFN half with the expand after attention, the head) are also compiled *with fixed shapes*
(`StepCompiled`): keyed by their inputs' shapes, so a decode batch of B rows traces each part once
per B and replays it from C++ afterwards — reshapes, slices, sorts, gathers and quantized matmuls
included, which shapeless tracing cannot carry. That removes the Python graph building of those
parts (docs/BENCHMARKS.md, "Issue 14, session 7: the decode step compiled"). Only steps whose every
segment is one token use them (a prefill chunk's length would be a new trace each time), and only
where nothing in the part reads from the device while its graph is built (the MoE's padded layout
does; it stays plain). Compiled and plain steps give the same bits on the CPU
(tests/equivalence/test_step_compiled.py).

Switch: TESSERA_COMPILE_STEP=1 turns the fixed-shape step compilation on (0, the default, off;
independent of TESSERA_COMPILE, whose shapeless functions run inside the step's trace either way);
`set_step_compile_enabled` flips it in a running process. Off by default: on the H200 a compiled
batch-1 step at 65,536 took 0.74× the plain one (6.48 against 8.80 ms), but the first step took 61 s
(tracing and compiling every fused kernel, on a machine with an empty MLX PTX cache), and every new
decode batch size traces again (with it on, `tessera serve` pays that at start-up: engine/serving/
warm_up.py). Compiled and plain steps give the same bits on the H200 too (docs/BENCHMARKS.md, "Session
7 on the H200 … final lease", "Session 8 on the H200"). On the CPU it gives the same bits and no speed
(docs/BENCHMARKS.md, "Issue 14, session 7: the decode step compiled").
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from tessera.kernels import gather_qmv, row_gather, sinkhorn
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

STEP_ENV_VAR = "TESSERA_COMPILE_STEP"
_step_switch = Switch(STEP_ENV_VAR, default=False)


def step_compile_enabled() -> bool:
    return _step_switch.enabled()


def set_step_compile_enabled(enabled: bool) -> None:
    """Turns the fixed-shape step compilation on or off for every later step."""
    _step_switch.set(enabled)


def _trace_switches() -> tuple[bool, ...]:
    """Every switch a step part reads while it is traced: a trace replays the choices it was traced
    with, so a flip in a running process (benchmarks) must reach a fresh trace, not a stale one."""

    return (compile_enabled(), sinkhorn.kernel_enabled(), row_gather.kernel_enabled(), gather_qmv.kernel_enabled())


class StepCompiled:
    """`fn` compiled with fixed shapes: one trace per distinct input shapes (and switch settings,
    `_trace_switches`), replayed from C++ after that. `fn` must be pure over its array arguments:
    what it closes over (weights) is a constant of the trace, and it must not evaluate anything that
    depends on its arguments (no `mx.eval`, `.item()`, `.tolist()` inside). Arrays it closes over
    that are made lazily on first use (cached properties that evaluate) must exist before the first
    call (`prime`). The caller decides when the compiled form applies (`step_compile_enabled` and
    shapes that stay few); `plain` is `fn` itself. `traces` counts how often `fn` was traced."""

    def __init__(self, fn: Callable, prime: Callable[[], object] | None = None) -> None:
        self.plain = fn
        self.traces = 0
        self._prime = prime
        self._compiled: dict[tuple[bool, ...], Callable] = {}

    def __call__(self, *args):
        key = _trace_switches()
        compiled = self._compiled.get(key)
        if compiled is None:
            if self._prime is not None:
                self._prime()
            compiled = self._compiled[key] = mx.compile(self._counted)
        return compiled(*args)

    def _counted(self, *args):
        self.traces += 1  # runs only while MLX traces: a replay does not call back into Python
        return self.plain(*args)
