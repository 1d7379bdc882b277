"""Pipeline parallelism on mx.distributed: each rank owns a contiguous range of layers (docs/PARALLEL.md)."""
