"""Pass/fail thresholds of `tessera check reference|consistency|kernels|parallel` (their flags' defaults). Plain values,
no MLX import, so the CLI can show them in --help without loading the model code."""

from __future__ import annotations

from dataclasses import dataclass

# check reference: float32 on random checkpoints differs from transformers by ~1e-6 (tests/equivalence).
REFERENCE_MAX_ABS_DIFF = 1e-4
REFERENCE_MIN_TOP1_AGREEMENT = 1.0

# check kernels: bf16 inputs, fp32 sums in another order; measured 1.9e-7 on an H200
# (docs/bench/h200-check-kernels.json). Integer-valued inputs must match bit for bit whatever this says.
KERNEL_MAX_REL_DIFF = 1e-5
KERNEL_MAX_DIFFERING_ROWS = 0


# check gpu, device vs CPU (engine/tools/device_agreement.py): float32 with no discrete choice to flip; CUDA's
# TF32 matmuls give ~1e-3 relative, a wrong op gives O(1) (session 8 saw 0.9 on a 1-token prompt).
DEVICE_AGREEMENT_MAX_REL_DIFF = 2e-2

# check parallel: a pipeline split runs the same arithmetic on the same shapes as one process (measured: 0.0).
PARALLEL_MAX_ABS_DIFF = 1e-5


@dataclass(frozen=True)
class ConsistencyLimits:
    """The most each difference may be for `check consistency` to pass."""

    untiled_diff: float = 0.0  # tiled vs untiled logits: the tiling contract is bit-identity
    whole_sequence_diff: float = 1e-4  # decode vs a fresh whole prefill: float32 rounding across gemm heights
    differing_selections: int = 0
