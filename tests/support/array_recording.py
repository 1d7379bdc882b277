"""Every `mx.array(...)` call recorded, whoever makes it: for counting the arrays a decode step makes from host
values (kernels/host_arrays.py; tests/test_host_arrays.py and docs/bench/host_arrays_per_step.py)."""

from __future__ import annotations

import mlx.core as mx


def recording_array_class(made: list[mx.array]) -> type:
    """A stand-in for `mx.array`: calling it makes the real array and appends it to `made`; isinstance checks
    against it answer for real arrays, so code that tests `isinstance(x, mx.array)` runs unchanged. Install it
    with `mx.array = …` (or monkeypatch.setattr), which every module's `mx.array(...)` then calls."""
    real = mx.array

    class Recording(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, real)

        def __call__(cls, *args, **kwargs):
            out = real(*args, **kwargs)
            made.append(out)
            return out

    return Recording("array", (), {})
