"""Compiles custom-kernel sources with NVRTC as MLX's `mx.fast.cuda_kernel` wraps them, on a machine without a
GPU: a kernel written away from the H200 is at least known to compile before a lease spends time on it.

python docs/bench/nvrtc_compile_check.py --nvrtc LIBNVRTC [--arch sm_90]

LIBNVRTC: libnvrtc.so.12, e.g. from the `nvidia-cuda-nvrtc-cu12` wheel (`pip download --no-deps
nvidia-cuda-nvrtc-cu12`, then unzip: nvidia/cuda_nvrtc/lib/libnvrtc.so.12). The wrapper follows MLX 0.32's
`build_kernel` (backend/cuda/custom_kernel.cpp): the kernel's signature (each input a const pointer, `NAME_shape`
where the source uses it, each output a pointer), its template arguments as `constexpr int`, then the source.
MLX's own device header is not available here: `Shape` is declared as it declares it (an array of MAX_NDIM
int32), so kernels that need more of that header, or CUDA's (cuda_bf16.h: the indexer), are not checked.
Checked: kernels/sinkhorn.py, a thread per token and the warp layout. One line per kernel: ok, or NVRTC's log.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from tessera.kernels import sinkhorn  # noqa: E402

PRELUDE = """
#define MAX_NDIM 10
struct Shape { int data[MAX_NDIM]; __device__ int operator[](int i) const { return data[i]; } };
namespace mlx::core::cu {
"""


@dataclass(frozen=True)
class KernelText:
    name: str
    source: str
    inputs: tuple[tuple[str, str], ...]  # (name, CUDA element type)
    outputs: tuple[tuple[str, str], ...]
    template: tuple[tuple[str, int], ...]


def wrapped(kernel: KernelText) -> str:
    """The translation unit MLX compiles for `kernel` (its shape parameters where the source names them)."""
    params = []
    for name, ctype in kernel.inputs:
        params.append(f"    const {ctype}* {name}")
        if f"{name}_shape" in kernel.source:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    params += [f"    {ctype}* {name}" for name, ctype in kernel.outputs]
    constants = "".join(f"  constexpr int {name} = {value};\n" for name, value in kernel.template)
    return (f"{PRELUDE}\n__global__ void {kernel.name}(\n" + ",\n".join(params) + ") {\n" + constants + "\n"
            + kernel.source + "\n}\n\n} // namespace mlx::core::cu\n")


def compile_ptx(nvrtc: ctypes.CDLL, text: str, name: str, arch: str) -> tuple[bool, str]:
    """-> (compiled, NVRTC's log)."""
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), text.encode(), f"{name}.cu".encode(), 0, None, None):
        return False, "nvrtcCreateProgram failed"
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status == 0, log.value.decode(errors="replace").strip()


def checked_kernels() -> list[KernelText]:
    hc, iters, eps = 4, 20, 1e-6  # V4's hyper-connections
    template = tuple(sinkhorn.kernel_template(hc, iters, eps))
    io = ((("comb", "float"),), (("out", "float"),))
    return [KernelText("tessera_sinkhorn", sinkhorn._SOURCE, *io, template),
            KernelText("tessera_sinkhorn_warp", sinkhorn._WARP_SOURCE, *io,
                       template + (("TOKENS_PER_WARP", sinkhorn.tokens_per_warp(hc)),))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvrtc", required=True, help="path of libnvrtc.so.12")
    p.add_argument("--arch", default="sm_90", help="the H200's")
    args = p.parse_args()
    nvrtc = ctypes.CDLL(args.nvrtc)
    failed = 0
    for kernel in checked_kernels():
        ok, log = compile_ptx(nvrtc, wrapped(kernel), kernel.name, args.arch)
        failed += not ok
        print(f"{kernel.name}: {'ok' if ok else 'FAILED'}" + (f"\n{log}" if log else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
