"""The primitives of an unevaluated MLX graph, by kind, read from `mx.export_to_dot`: what the tests that bound a
graph's size (nodes a decode step builds, kernels a path launches) count."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import mlx.core as mx


def primitive_kinds(arrays, path: Path) -> collections.Counter:
    """Primitive kind -> how many nodes of it build `arrays` (one array or several); evaluated inputs are
    leaves, not counted. `path`: where the dot file is written."""
    mx.export_to_dot(str(path), *(arrays if isinstance(arrays, (list, tuple)) else [arrays]))
    return collections.Counter(re.findall(r'label ?= ?"([^"]+)", shape ?= ?rectangle', Path(path).read_text()))
