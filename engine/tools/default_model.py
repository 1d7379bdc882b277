"""The embedded default model: a small random-weight V4 checkpoint with a byte-level tokenizer,
generated deterministically on first start so `tessera serve` works with no arguments."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.tools.make_model import make_model

DEFAULT_PRESET, DEFAULT_SEED = "tiny", 0
_COMPLETE = ".complete"


def default_cache_dir() -> Path:
    root = os.environ.get("TESSERA_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    return Path(root) / f"default-v4-{DEFAULT_PRESET}-seed{DEFAULT_SEED}"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the default model directory, generating it first if needed (seconds on a laptop)."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / _COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash mid-way never leaves a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        make_model(staging, DEFAULT_PRESET, seed=DEFAULT_SEED, with_tokenizer=True)
        (staging / _COMPLETE).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
