"""Which BLAS the CPU backend's matmuls run on, for a line in the startup log.

The mlx[cpu] wheel for Linux bundles the reference (netlib) BLAS: correct, but ~11x slower than OpenBLAS for
our fp32 matmuls (a 10,729-token prompt: 176.6 s against 15.9 s). Preloading Debian's OpenBLAS replaces its
symbols (`make serve` does so when the library is installed). Nothing else says which one runs, so the
server logs it, and for the slow one the exact command that fixes it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

OPENBLAS_LIBRARY = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
FIX = (f"apt-get install libopenblas0-pthread, then start the server with LD_PRELOAD={OPENBLAS_LIBRARY} "
       "(make serve sets it when the file exists)")


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "OpenBLAS", "reference BLAS", "Accelerate", "MKL" or "unknown"
    library: str | None  # the mapped file it was recognised by
    is_slow: bool

    def describe(self) -> str:
        where = f" ({self.library})" if self.library else ""
        if self.is_slow:
            return (f"CPU matmuls use the {self.name}{where}, about 11x slower than OpenBLAS. To fix: {FIX}")
        return f"CPU matmuls use {self.name}{where}"


def blas_in_use() -> BlasInfo:
    """Read this process's mapped libraries (Linux) after MLX is imported. An OpenBLAS or MKL that provides the
    plain BLAS symbols can only be there by preloading (or a system libblas pointing at it), and the dynamic
    linker then resolves MLX's calls to it; else the bundled reference libblas serves them. numpy's own
    OpenBLAS (`scipy_openblas`) uses suffixed symbol names and serves nobody else, so it does not count."""
    import mlx.core  # noqa: F401 — its BLAS is mapped only once MLX is loaded

    if sys.platform == "darwin":
        return BlasInfo("Accelerate", None, is_slow=False)
    libraries = [lib for lib in _mapped_libraries() if "scipy_openblas" not in lib.lower()]
    for marker, name in (("openblas", "OpenBLAS"), ("mkl", "MKL")):
        found = next((lib for lib in libraries if marker in lib.lower()), None)
        if found is not None:
            return BlasInfo(name, found, is_slow=False)
    # netlib's libblas.so.3: the mlx[cpu] wheel's bundled copy, or Debian's reference one under /blas/
    reference = next((lib for lib in libraries if Path(lib).name.lower().startswith("libblas")), None)
    if reference is not None:
        return BlasInfo("reference BLAS", reference, is_slow=True)
    return BlasInfo("unknown", None, is_slow=False)


def _mapped_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/" in line and ".so" in line]
    except OSError:
        return []
    return list(dict.fromkeys(paths))  # in mapping order, once each
