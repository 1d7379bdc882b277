"""What the CUDA kernels share: whether MLX runs on a CUDA device, and building a kernel once."""

from __future__ import annotations

from functools import cache

import mlx.core as mx


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@cache
def compiled_kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str, header: str):
    """`mx.fast.cuda_kernel` for this source, built on first use (compilation happens at first call)."""
    return mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=source, header=header)
