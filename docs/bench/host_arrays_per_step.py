"""How many arrays a steady serving decode step makes from host values, on the CPU with the CUDA path's kernels
stood in (docs/BENCHMARKS.md "Session 17"; docs/ARCHITECTURE.md "Host-made arrays").

python docs/bench/host_arrays_per_step.py MODEL OUT.jsonl [--ctx 2048] [--batch 16] [--steps 8] [--warm-steps 256]
    [--as-loaded]

B sequences at CTX + b % 4 tokens (random cache rows; so a quarter of them close a CSA window each step), then at
batch 1 and batch B the serving step with the decode overlap (`tessera serve`'s: the tokens stay on the device),
warmed for `--warm-steps` (256: every open-slot pattern of a ratio-128 compressor seen twice), then `--steps` steps
counted: every `mx.array(...)` any code calls, by its byte size (`mx.array` replaced by a class that records the
call and still answers isinstance checks). With the CUDA path taken on the CPU (`on_cuda()` true, each custom
kernel a zeros array that depends on its inputs), a step's index arrays are the ones the H200 makes. One JSON
line per batch size and TESSERA_HOST_ARRAY_CACHE setting (0, then 1): per step, all arrays and those over 8 bytes
(on CUDA the ones that come from MLX's shared buffer cache, not its small pool), and the custom-kernel launches
the stood-in CUDA path made per step (none would mean the CPU's path was measured).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run by path from anywhere: the repo root
from tests.support.source_tree import use_source_tree  # noqa: E402

use_source_tree()  # `tessera.*` = this checkout, unless it already is

from docs.bench.issue14_decode_overlap import serving_steps  # noqa: E402
from docs.bench.probe_io import jsonl_emitter, load_probe_model  # noqa: E402
from tessera.engine.tools.bench_decode import DecodeOptions, _filled  # noqa: E402
from tessera.kernels import host_arrays  # noqa: E402
from tests.support.array_recording import recording_array_class  # noqa: E402

KERNEL_MODULES = ("tessera.engine.model.moe", "tessera.kernels.mxfp8_qmv", "tessera.kernels.indexer_cuda",
                  "tessera.kernels.row_gather", "tessera.kernels.moe_padded", "tessera.kernels.sinkhorn",
                  "tessera.kernels.gather_qmv", "tessera.kernels.topk_cuda")

LAUNCHES = [0]  # custom-kernel launches the stood-in CUDA path made


def stood_in_kernel(name, inputs, outputs, source, header):
    """`compiled_kernel` on the CPU: a launch returns zeros of the output shapes that depend on the inputs."""
    def launch(inputs, output_shapes, output_dtypes, **_):
        LAUNCHES[0] += 1
        return mx.depends([mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)],
                          list(inputs))
    return launch


def take_the_cuda_path() -> None:
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "on_cuda"):
            module.on_cuda = lambda: True
        if hasattr(module, "compiled_kernel"):
            module.compiled_kernel = stood_in_kernel
        for getter in ("_kernel", "_batched_kernel"):  # kernels cached before the stand-in
            cached = getattr(module, getter, None)
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warm-steps", type=int, default=256)
    p.add_argument("--as-loaded", action="store_true", help="keep a quantized checkpoint's weights as loaded")
    args = p.parse_args()
    emit = jsonl_emitter(args.out)
    take_the_cuda_path()
    model = load_probe_model(args.model, args.as_loaded)
    options = DecodeOptions(chunk=1024, tile=512, cache_fill="random")
    caches = [_filled(model, args.ctx + b % 4, b, options) for b in range(args.batch)]
    made: list[mx.array] = []
    mx.array = recording_array_class(made)  # every call from now on, by any code
    run = serving_steps(True)
    for cache_on in (False, True):
        host_arrays.set_cache_enabled(cache_on)
        for batch in (1, args.batch):
            run(model, caches[:batch], args.warm_steps)
            made.clear()
            run(model, caches[:batch], 1)  # the runner's setup and one step
            setup = len(made), sum(a.nbytes > 8 for a in made), LAUNCHES[0]
            made.clear()
            run(model, caches[:batch], 1 + args.steps)
            every, large = len(made) - setup[0], sum(a.nbytes > 8 for a in made) - setup[1]
            emit("host_arrays", batch=batch, host_array_cache=cache_on, ctx=args.ctx, per_step=every / args.steps,
                 over_8_bytes_per_step=large / args.steps, cuda_kernels_per_step=(LAUNCHES[0] - setup[2]) / args.steps)


if __name__ == "__main__":
    main()
