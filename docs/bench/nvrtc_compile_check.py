"""Compiles every custom CUDA kernel's source with NVRTC, wrapped as MLX's `mx.fast.cuda_kernel` wraps it, on a
machine without a GPU: a kernel edited away from the H200 is at least known to compile (tests/test_kernels.py
runs this in CI).

python docs/bench/nvrtc_compile_check.py [--nvrtc LIBNVRTC --include DIR] [--arch sm_90]

NVRTC and CUDA's headers: by default those of the `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` wheels (the test
extra pins the versions the H200's MLX CUDA build runs with), found under the installed `nvidia/cu13/`. The
wrapper follows MLX 0.32's `build_kernel` (backend/cuda/custom_kernel.cpp): each input a const pointer of its
element type, `NAME_shape` / `NAME_strides` / `NAME_ndim` where the source names them, each output a pointer, the
template arguments as `constexpr int` or `using NAME = TYPE`, then the source, in namespace mlx::core::cu. MLX's
own device header is not in the wheels: the prelude declares what the kernels take from it (`Shape`, `Strides`,
the fixed-width integer types) and includes CUDA's half and bfloat16 headers, as it does. Each kernel is checked
at V4 Flash's widths. One line per kernel: ok, or NVRTC's log; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from tessera.kernels import decode_attention_cuda, gather_qmv, hc_collapse, hc_expand, hc_mix, indexer_cuda, moe_padded, moe_route, mxfp8_qmv, rms_norm_cuda, row_gather, sinkhorn, topk_cuda  # noqa: E402

PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;
#define MAX_NDIM 10
struct Shape { int32_t data[MAX_NDIM]; __device__ int32_t operator[](int i) const { return data[i]; } };
struct Strides { int64_t data[MAX_NDIM]; __device__ int64_t operator[](int i) const { return data[i]; } };
"""

CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.int32: "int32_t",
              mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int64: "int64_t", mx.bool_: "bool"}


@dataclass(frozen=True)
class KernelText:
    """One kernel as `compiled_kernel` gets it (name, input and output names, source, header), with the element
    types and template arguments a call passes."""

    name: str
    inputs: tuple[tuple[str, mx.Dtype], ...]
    outputs: tuple[tuple[str, mx.Dtype], ...]
    source: str
    header: str
    template: tuple[tuple[str, int | mx.Dtype], ...]


def wrapped(kernel: KernelText) -> str:
    """The translation unit MLX compiles for `kernel`."""
    params = []
    for name, dtype in kernel.inputs:
        params.append(f"    const {CUDA_TYPES[dtype]}* {name}")
        for suffix, kind in (("shape", "const __grid_constant__ Shape"), ("strides", "const __grid_constant__ Strides"),
                             ("ndim", "const __grid_constant__ int")):
            if f"{name}_{suffix}" in kernel.source:
                params.append(f"    {kind} {name}_{suffix}")
    params += [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in kernel.outputs]
    constants = "".join(f"  constexpr int {name} = {value};\n" if isinstance(value, int)
                        else f"  using {name} = {CUDA_TYPES[value]};\n" for name, value in kernel.template)
    return (f"{PRELUDE}\n{kernel.header}\nnamespace mlx::core::cu {{\n\n__global__ void {kernel.name}(\n"
            + ",\n".join(params) + ") {\n" + constants + "\n" + kernel.source + "\n}\n\n} // namespace mlx::core::cu\n")


def decode_attention_texts() -> list[KernelText]:
    """kernels/decode_attention_cuda.py's two kernels, one and two groups each: bf16 and fp16 at V4 Flash's CSA
    shapes (64 heads of 512), and bf16 at the bounds the shared arrays are sized by (MAX_HEADS; 16 heads of 256)."""
    dac, f32, texts = decode_attention_cuda, mx.float32, []
    for dtype, heads, dim in ((mx.bfloat16, 64, 512), (mx.float16, 64, 512), (mx.bfloat16, dac.MAX_HEADS, 512), (mx.bfloat16, 16, 256)):
        for groups, rows in ((1, (("rows_a", dtype), ("valid_a", mx.bool_))),
                             (2, (("rows_a", dtype), ("valid_a", mx.bool_), ("rows_b", dtype), ("valid_b", mx.bool_)))):
            suffix = ("" if dtype == mx.bfloat16 else "_float16") + ("" if (heads, dim) == (64, 512) else f"_{heads}x{dim}")
            texts.append(KernelText(dac.logits_kernel_name(groups) + suffix, (("q", dtype),) + rows, (("products", dtype), ("stats", f32)),
                                    dac._LOGITS_SOURCES[groups], dac._HEADER, tuple(dac.logits_template(dtype, heads, dim, dim**-0.5))))
            row_inputs = tuple(r for r in rows if r[0].startswith("rows"))
            texts.append(KernelText(dac.output_kernel_name(groups) + suffix, (("products", dtype), ("stats", f32)) + row_inputs + (("sinks", f32),),
                                    (("out", dtype),), dac._OUTPUT_SOURCES[groups], dac._HEADER,
                                    tuple(dac.output_template(dtype, f32, heads, dim, dim**-0.5))))
    dac.force_block_heads(32)  # the probe's other layout of the output kernel
    try:
        other = tuple(dac.output_template(mx.bfloat16, f32, 64, 512, 512**-0.5))
    finally:
        dac.force_block_heads(None)
    texts.append(KernelText(dac.output_kernel_name(2) + "_32_heads_a_block", texts[3].inputs, texts[3].outputs, texts[3].source,
                            dac._HEADER, other))
    return texts


def rms_norm_texts() -> list[KernelText]:
    """kernels/rms_norm_cuda.py's kernel: weighted with a float32 weight at V4 Flash's hidden width (MAX_WIDTH: the
    most registers a lane holds) and a bf16 one at its head dim, unweighted at the head dim, fp16 rows."""
    rn, bf16, f16, f32, texts = rms_norm_cuda, mx.bfloat16, mx.float16, mx.float32, []
    for name, dtype, weight, width in (("hidden", bf16, f32, rn.MAX_WIDTH), ("head", bf16, bf16, 512), ("unweighted", bf16, None, 512),
                                       ("float16", f16, f32, 1536)):
        weighted = weight is not None
        inputs = (("rows", dtype),) + ((("weight", weight),) if weighted else ())
        texts.append(KernelText(f"{rn.kernel_name(weighted)}_{name}", inputs, (("out", dtype),), rn.kernel_source(weighted),
                                rn._HEADER, tuple(rn.kernel_template(dtype, weight, width, 1e-6))))
    return texts


def hc_collapse_texts() -> list[KernelText]:
    """kernels/hc_collapse.py's kernels: a layer's with bf16 streams and a bf16 and a float32 norm weight, and with
    float32 streams; the head's with bf16; V4's hc = 4 at V4 Flash's hidden 4096."""
    texts = []
    for dtype, weight in ((mx.bfloat16, mx.bfloat16), (mx.bfloat16, mx.float32), (mx.float32, mx.float32)):
        texts.append(KernelText(hc_collapse.KERNEL_NAME, (("logits", mx.float32), ("streams", dtype), ("weight", weight)),
                                (("post", mx.float32), ("mix_t", dtype), ("normed", dtype)), hc_collapse._SOURCE,
                                hc_collapse._HEADER, tuple(hc_collapse.kernel_template(dtype, weight, 4, 20, 1e-6, 1e-6))))
    texts.append(KernelText(hc_collapse.HEAD_KERNEL_NAME, (("logits", mx.float32), ("streams", mx.bfloat16),
                                                          ("weight", mx.bfloat16)), (("normed", mx.bfloat16),),
                            hc_collapse._HEAD_SOURCE, hc_collapse._HEADER,
                            tuple(hc_collapse.kernel_template(mx.bfloat16, mx.bfloat16, 4, 0, 1e-6, 1e-6))))
    return texts


def hc_expand_texts() -> list[KernelText]:
    """kernels/hc_expand.py's kernels: the expand with bf16 and float32 streams, and the MoE's pairs and expand with
    bf16 streams and V4's six slots; hc = 4 (V4's)."""
    texts = []
    for dtype in (mx.bfloat16, mx.float32):
        texts.append(KernelText(hc_expand.KERNEL_NAME, (("block_out", dtype), ("streams", dtype), ("post", mx.float32),
                                                        ("mix_t", dtype)), (("out", dtype),), hc_expand._SOURCE,
                                hc_expand._HEADER, tuple(hc_expand.kernel_template(dtype, 4))))
    bf16 = mx.bfloat16
    texts.append(KernelText(hc_expand.PAIRS_KERNEL_NAME, (("rows", bf16), ("weights", mx.float32), ("shared", bf16),
                                                          ("streams", bf16), ("post", mx.float32), ("mix_t", bf16)),
                            (("out", bf16),), hc_expand._PAIRS_SOURCE, hc_expand._HEADER,
                            tuple(hc_expand.kernel_template(bf16, 4, 6))))
    return texts


def moe_route_texts() -> list[KernelText]:
    """kernels/moe_route.py's kernels at V4 Flash's router (256 experts, top-6, scaling 1.5): learned routing with a
    float32 bias, hash routing with a uint32 table and int32 token ids (the tokens a runtime shape)."""
    f32, u32, template = mx.float32, mx.uint32, tuple(moe_route.kernel_template(256, 6, 1.5))
    outputs = (("experts", u32), ("weights", f32))
    return [
        KernelText(moe_route.KERNEL_NAME, (("logits", f32), ("bias", f32)), outputs, moe_route._SOURCE, moe_route._HEADER,
                   (("B", f32),) + template),
        KernelText(moe_route.HASH_KERNEL_NAME, (("logits", f32), ("tid2eid", u32), ("token_ids", mx.int32)), outputs,
                   moe_route._HASH_SOURCE, moe_route._HEADER, (("M", u32), ("I", mx.int32)) + template),
    ]


def checked_kernels() -> list[KernelText]:
    """Every kernel in kernels/, at V4 Flash's widths (batched kernels at 16 buffers)."""
    bf16, f32, i32, u32, u8 = mx.bfloat16, mx.float32, mx.int32, mx.uint32, mx.uint8
    sink = tuple(sinkhorn.kernel_template(4, 20, 1e-6, bf16))
    gather_name, gather_inputs, gather_outputs, gather_source = row_gather._batched_kernel_text(16)
    index_name, index_inputs, index_outputs, index_source = indexer_cuda._batched_kernel_text(16)
    heads, d = 64, 128
    return [
        KernelText("tessera_sinkhorn", (("probs", f32),), (("out", bf16),), sinkhorn._SOURCE, "", sink),
        KernelText("tessera_sinkhorn_warp", (("probs", f32),), (("out", bf16),), sinkhorn._WARP_SOURCE, sinkhorn.LANE_HEADER,
                   sink + (("TOKENS_PER_WARP", sinkhorn.tokens_per_warp(4)),)),
        KernelText("tessera_hc_mix", (("flat", bf16), ("fn", f32), ("scale", f32), ("base", f32)), (("out", f32),),
                   hc_mix._SOURCE, hc_mix.HEADER, tuple(hc_mix.kernel_template(bf16, 1e-6))),
        *hc_collapse_texts(),
        *hc_expand_texts(),
        *moe_route_texts(),
        *decode_attention_texts(),
        *rms_norm_texts(),
        KernelText("tessera_take_rows", (("x", bf16), ("idx", i32)), (("out", bf16),), row_gather._SOURCE, "",
                   (("VECTORS_PER_ROW", 4096 * 2 // row_gather.VECTOR_BYTES),)),
        KernelText(gather_name, (("idx", i32), *((n, bf16) for n in gather_inputs[1:])), ((gather_outputs[0], bf16),),
                   gather_source, "", (("VECTORS_PER_ROW", 512 * 2 // row_gather.VECTOR_BYTES),)),
        KernelText("tessera_indexer_scores", (("q", bf16), ("w", f32), ("k", bf16), ("visible", i32)), (("scores", f32),),
                   indexer_cuda._SOURCE, indexer_cuda._HEADER, (("H", heads), ("D", d), ("KS", d // 16))),
        KernelText(index_name, (("qs", bf16), ("ws", f32), ("visibles", i32), ("sizes", i32),
                                *((n, bf16) for n in index_inputs[4:])), ((index_outputs[0], f32),),
                   index_source, indexer_cuda._HEADER, (("H", heads), ("D", d), ("KS", d // 16), ("NB", 16))),
        KernelText("tessera_topk_radix", (("scores", f32), ("k_in", i32), ("visible", i32)), (("rows", i32), ("valid", mx.bool_)), topk_cuda._SOURCE,
                   topk_cuda._HEADER, ()),
        KernelText("tessera_mxfp8_qmv", (("x", bf16), ("w", u32), ("scales", u8)), (("out", bf16),), mxfp8_qmv._SOURCE,
                   mxfp8_qmv._HEADER, (("T", bf16), ("K", 4096), ("N", 1536), ("WR", mxfp8_qmv.WEIGHT_ROWS), ("RB", 16),
                                       ("THREADS", mxfp8_qmv.THREADS))),
        KernelText("tessera_gather_qmv_mxfp4", (("x", bf16), ("w", u32), ("scales", u8), ("experts", u32)), (("out", bf16),),
                   gather_qmv._SOURCE, gather_qmv._HEADER, (("T", bf16), ("K", 4096), ("N", 2048), ("ROWS", gather_qmv.ROWS_PER_BLOCK),
                                                           ("UNROLL", gather_qmv.UNROLL), ("STAGE_X", 1),
                                                           ("X_DIV", 6))),
        KernelText("tessera_gather_qmv_mxfp4_mma", (("x", bf16), ("w", u32), ("scales", u8), ("experts", u32)),
                   (("out", bf16),), gather_qmv._MMA_SOURCE, gather_qmv._MMA_HEADER,
                   (("T", bf16), ("K", 4096), ("N", 2048), ("ROWS", gather_qmv.MMA_ROWS), ("WARPS", gather_qmv.MMA_WARPS),
                    ("UNROLL", gather_qmv.MMA_UNROLL), ("X_DIV", 6))),
        KernelText("tessera_moe_combine_rows", (("rows", bf16), ("slot", i32), ("weights", f32)), (("out", f32),),
                   moe_padded._COMBINE_SOURCE, "", (("T", bf16), ("K", 6), ("VECTORS_PER_ROW", 4096 * 2 // moe_padded.VECTOR_BYTES))),
        KernelText("tessera_moe_padded_indices", (("order", u32), ("flat", u32), ("counts", i32), ("params", i32)),
                   (("tokens", i32), ("slot", i32)), moe_padded._INDEX_SOURCE, "", (("E", 256), ("K", 6))),
    ]


def compile_ptx(nvrtc: ctypes.CDLL, text: str, name: str, arch: str, include: Path) -> tuple[bool, str]:
    """-> (compiled, NVRTC's log)."""
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), text.encode(), f"{name}.cu".encode(), 0, None, None):
        return False, "nvrtcCreateProgram failed"
    options = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"--include-path={include}".encode()]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status == 0, log.value.decode(errors="replace").strip()


def installed_cuda() -> tuple[Path, Path] | None:
    """(libnvrtc, include dir) of the installed `nvidia-cuda-nvrtc` / `nvidia-cuda-runtime` wheels, or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        cu13 = Path(root) / "cu13"
        if (cu13 / "lib" / "libnvrtc.so.13").exists() and (cu13 / "include" / "cuda_bf16.h").exists():
            return cu13 / "lib" / "libnvrtc.so.13", cu13 / "include"
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvrtc", type=Path, help="libnvrtc.so (default: the installed nvidia-cuda-nvrtc wheel's)")
    p.add_argument("--include", type=Path, help="CUDA's headers (default: the installed nvidia-cuda-runtime wheel's)")
    p.add_argument("--arch", default="sm_90", help="the H200's")
    args = p.parse_args()
    found = installed_cuda()
    lib, include = args.nvrtc or (found and found[0]), args.include or (found and found[1])
    if not lib or not include:
        print("no NVRTC: install the test extra (nvidia-cuda-nvrtc, nvidia-cuda-runtime) or pass --nvrtc and --include")
        return 2
    for builtins in sorted(Path(lib).parent.glob("libnvrtc-builtins.so.*")):  # NVRTC opens it by name: load it first
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(lib))
    failed = 0
    for kernel in checked_kernels():
        ok, log = compile_ptx(nvrtc, wrapped(kernel), kernel.name, args.arch, include)
        failed += not ok
        print(f"{kernel.name}: {'ok' if ok else 'FAILED'}" + ("" if ok else f"\n{log}"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
