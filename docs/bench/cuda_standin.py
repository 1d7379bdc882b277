"""The CUDA path's graph, built on a machine without CUDA, to count its primitives there.

MLX's CUDA backend pays a roughly constant host cost per primitive (docs/BENCHMARKS.md, "Session 28 on an
H100"), so a decode step's primitive count is what its host time is made of. That count is the CUDA path's
own: there the step runs the kernels of kernels/ (one `CustomKernel` node each), on the CPU their plain-MLX
references (many nodes each). Counting it took a GPU lease; `cuda_graph_on_cpu()` builds the same graph here:
- every `on_cuda()` the engine asks answers yes, and the step is compiled as on a GPU (compiled.py) with the
  MoE's host work overlapped as on a GPU (moe.py);
- every CUDA kernel is stood in by one `Depends` node on the kernel's inputs, whose outputs are zeros of the
  kernel's output shapes and dtypes. Zeros keep every index a kernel would return in bounds (row 0, expert 0);
- `mx.fast.rms_norm`, one `RMSNorm` node on a GPU but a few fused ops on the CPU, is stood in by one `CumMax`
  node, after the cast MLX's GPU path makes (the rows to the output's dtype).

Only the graph is the CUDA path's: its values are not (zeros where the kernels' outputs would be), so the
stand-in is for counting and never for numbers. `STANDIN_KINDS` maps the stand-ins' node labels to the kinds
they stand for. The preconditions that pick a kernel read shapes, dtypes and switches only, never values, so the
same kernels are picked as on a GPU for the same model and shapes (checked against an H100's count in
docs/BENCHMARKS.md, "Session 34").
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import mlx.core as mx

from tessera.engine.model import compiled, moe
from tessera.kernels import (cuda, decode_attention_cuda, gather_qmv, hc_collapse, hc_expand, hc_mix, indexer_cuda, moe_padded, moe_route,
                             mxfp8_qmv, rms_norm_cuda, row_gather, sinkhorn, topk_cuda)

# The stand-ins' node labels (kinds the engine never builds itself) -> the kinds they stand for.
STANDIN_KINDS = {"Depends": "CustomKernel", "CumMax": "RMSNorm"}
# Every module that imported `on_cuda` or `compiled_kernel` by name (its own binding is what it calls).
_CUDA_USERS = (cuda, decode_attention_cuda, gather_qmv, hc_collapse, hc_expand, hc_mix, indexer_cuda, moe_padded, moe_route, mxfp8_qmv,
               rms_norm_cuda, row_gather, sinkhorn, topk_cuda, moe)


def _standin_launch(*, inputs: Sequence[mx.array], output_shapes: Sequence[Sequence[int]],
                    output_dtypes: Sequence[mx.Dtype], **launch) -> list[mx.array]:
    """Called as an `mx.fast.cuda_kernel` is: one graph node on `inputs`, zeros of the output shapes. The
    launch arguments (grid, threadgroup, template, init_value) shape no node, so they are not read."""
    zeros = [mx.zeros(tuple(shape), dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
    mx.eval(zeros)  # evaluated: leaves of the graph, so the stand-in is the one node a kernel is
    return mx.depends(zeros, list(inputs))


def standin_kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str, header: str):
    """kernels/cuda.py's `compiled_kernel`, with nothing compiled: every kernel launches as `_standin_launch`."""
    return _standin_launch


def standin_rms_norm(x: mx.array, weight: mx.array | None, eps: float, *, stream=None) -> mx.array:
    """`mx.fast.rms_norm`'s graph on a GPU: x cast to the output's dtype, then one node on it. A weight is a
    loaded array (a leaf, no node), left out: `Depends` cannot stand in here, since norms also run inside
    shapeless compiled functions, which need every node's output shape."""
    dtype = x.dtype if weight is None else mx.result_type(x, weight)
    if weight is not None and weight.dtype != dtype:
        raise ValueError(f"the norm stand-in leaves the weight out, but its cast to {dtype} would be a node")
    return mx.cummax(x.astype(dtype), axis=-1)  # CumMax: one node of x's shape that the engine never builds


@contextlib.contextmanager
def cuda_graph_on_cpu() -> Iterator[None]:
    """Within: the engine builds the CUDA path's graph on the CPU (this module's docstring). Restored after."""
    saved = [(m, name, getattr(m, name)) for m in _CUDA_USERS for name in ("on_cuda", "compiled_kernel") if hasattr(m, name)]
    saved_overlap, saved_compile, saved_norm = moe.OVERLAP_HOST_WORK, compiled.step_compile_enabled(), mx.fast.rms_norm
    try:
        for module, name, _ in saved:
            setattr(module, name, (lambda: True) if name == "on_cuda" else standin_kernel)
        mx.fast.rms_norm = standin_rms_norm
        moe.OVERLAP_HOST_WORK = True
        compiled.set_step_compile_enabled(True)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        mx.fast.rms_norm = saved_norm
        moe.OVERLAP_HOST_WORK = saved_overlap
        compiled.set_step_compile_enabled(saved_compile)
