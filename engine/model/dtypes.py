"""The floating-point dtypes a checkpoint or a run may use, by the names configs and flags spell."""

from __future__ import annotations

import mlx.core as mx

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)
