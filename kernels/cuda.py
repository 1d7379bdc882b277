"""What the CUDA kernels share: whether MLX runs on a CUDA device, and building a kernel once."""

from __future__ import annotations

import struct
from functools import cache

import mlx.core as mx

from tessera.kernels.switch import Switch

# TESSERA_DECODE_BATCH_KERNELS=0 keeps a decode batch on the per-sequence CUDA path (the single indexer
# kernel once per sequence; the selected rows gathered from stacked buffers, or one gather per
# sequence): the same bits, to compare against the batched kernels (kernels/indexer_cuda.py,
# kernels/row_gather.py). 1, the default, uses them.
decode_batch_kernels = Switch("TESSERA_DECODE_BATCH_KERNELS")

SHARED_MEMORY_LIMIT = 48 * 1024  # a kernel's static __shared__ arrays beyond this do not compile


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@cache
def compiled_kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str, header: str):
    """`mx.fast.cuda_kernel` for this source, built on first use (compilation happens at first call)."""
    return mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=source, header=header)


def float_bits(value: float) -> int:
    """`value` as its float32 bit pattern, for a kernel's template (which takes integers only): the kernel reads it
    back with `__int_as_float` and computes with exactly the float32 its reference uses."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def input_slots(num: int) -> int:
    """Buffer inputs a per-batch kernel is generated with for `num` buffers: the next power of two, so
    batch sizes 1 … 16 compile 5 variants, not 16 (the unused slots repeat the last buffer, never read)."""
    return 1 << (num - 1).bit_length()
