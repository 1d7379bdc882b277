"""Fixed-shape `mx.compile` of a decode step's shape-stable parts, behind its own switch (the model's
small pure functions are compiled shapeless by kernels/shapeless.py, behind TESSERA_COMPILE).

The shape-stable parts of a decode step (engine/model/deepseek_v4.py: a layer's attention prologue,
attention's projections before and after its cache-dependent middle (attention.DecodeProjections), its FFN
half with the expand after attention, the head) are also compiled *with fixed shapes*
(`StepCompiled`): keyed by their inputs' shapes, so a decode batch of B rows traces each part once
per B and replays it from C++ afterwards — reshapes, slices, sorts, gathers and quantized matmuls
included, which shapeless tracing cannot carry. That removes the Python graph building of those
parts (docs/BENCHMARKS.md, "Issue 14, session 7: the decode step compiled"). Only steps whose every
segment is one token use them (a prefill chunk's length would be a new trace each time), and only
where nothing in the part reads from the device while its graph is built (the MoE's padded layout
does; it stays plain). Compiled and plain steps give the same bits on the CPU
(tests/equivalence/test_step_compiled.py).

Switch: TESSERA_COMPILE_STEP=1 turns the fixed-shape step compilation on, 0 off; unset, it is on where the
default device is a GPU and off on the CPU (independent of TESSERA_COMPILE, whose shapeless functions run
inside the step's trace either way); `set_step_compile_enabled` flips it in a running process.
- On a GPU: on the H200 the compiled step's host time is ~15 % lower (the device's own time is the same,
  ~2.3 ms at 65,536), and the serving step with the decode overlap took 4.66 against 5.24 ms at batch 1
  and 12.0 against 13.2 ms at batch 16 (16k, flash-width as loaded, A B B A in one process; every compiled
  round faster). Compiled and plain steps give the same bits there, logits and caches, at batch 1 and 16
  with the mxfp4 experts through kernels/gather_qmv.py (docs/BENCHMARKS.md, "Session 12 on the H200").
  The cost is a trace per decode batch size: `tessera serve` pays it at start-up (engine/serving/warm_up.py:
  1..max_num_seqs took 1.8 s with a warm PTX cache; on a fresh machine the first trace compiles the fused
  kernels, ~50 s, on top of the ~100 s every first decode step spends compiling MLX's own kernels).
- On the CPU it gives the same bits and no speed (docs/BENCHMARKS.md, "Issue 14, session 7: the decode step
  compiled"), and MLX compiles each fused kernel with the host's C++ compiler at first use (~12 s for the
  tiny preset's step): off unless asked for.
"""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx

from tessera.engine.model.quantized import dense_min_rows
from tessera.kernels import gather_qmv, hc_collapse, hc_expand, hc_mix, moe_route, mxfp8_qmv, rms_norm_cuda, row_gather, sinkhorn
from tessera.kernels.shapeless import compile_enabled
from tessera.kernels.switch import Switch

STEP_ENV_VAR = "TESSERA_COMPILE_STEP"
_step_switch: Switch | None = Switch(STEP_ENV_VAR) if STEP_ENV_VAR in os.environ else None  # None: by device


def step_compile_enabled() -> bool:
    if _step_switch is None:
        return mx.default_device() == mx.gpu
    return _step_switch.enabled()


def set_step_compile_enabled(enabled: bool) -> None:
    """Turns the fixed-shape step compilation on or off for every later step (whatever the device)."""
    global _step_switch
    _step_switch = _step_switch or Switch(STEP_ENV_VAR)
    _step_switch.set(enabled)


def _trace_switches() -> tuple[bool, ...]:
    """Every switch a step part reads while it is traced: a trace replays the choices it was traced
    with, so a flip in a running process (benchmarks) must reach a fresh trace, not a stale one."""

    return (compile_enabled(), sinkhorn.kernel_enabled(), sinkhorn.warp_enabled(), hc_mix.kernel_enabled(), hc_collapse.kernel_enabled(),
            hc_expand.kernel_enabled(), row_gather.kernel_enabled(), gather_qmv.kernel_enabled(), gather_qmv.mma_enabled(),
            mxfp8_qmv.kernel_enabled(), rms_norm_cuda.kernel_enabled(), moe_route.kernel_enabled(), dense_min_rows())


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
