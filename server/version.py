"""Which build is serving: the package version (/version) and OpenAI's `system_fingerprint`."""

from __future__ import annotations

import hashlib
import importlib.metadata
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def tessera_version() -> str:
    """The installed package's version; from pyproject.toml when running from a source tree."""
    try:
        return importlib.metadata.version("tessera")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


@lru_cache(maxsize=8)
def system_fingerprint(model_root: str) -> str:
    """OpenAI's `system_fingerprint` ("fp_" + 10 hex, on every completion object and chunk): it changes when
    the backend does (Tessera version or checkpoint), so a client using `seed` can tell when outputs may differ.
    OpenAI always sends the key; clients (and llama.cpp's and vLLM's suites) read it without a default."""
    digest = hashlib.sha256(f"tessera {tessera_version()} {model_root}".encode()).hexdigest()
    return "fp_" + digest[:10]
