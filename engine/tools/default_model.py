"""The embedded default model: a small random-weight V4 checkpoint with a byte-level tokenizer,
generated deterministically on first start so `tessera serve` works with no arguments."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tessera.engine.model.weights import expected_shapes
from tessera.engine.tools.make_model import preset_config, write_checkpoint
from tessera.engine.tools.tokenizer_train import train_tokenizer

logger = logging.getLogger(__name__)

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
    logger.info("no --model given: generating the default model (a random-weight V4 '%s', seed %d) in %s; this "
                "happens once, later starts reuse it", DEFAULT_PRESET, DEFAULT_SEED, target)
    started = time.monotonic()
    # Build beside the target and rename, so a crash mid-way never leaves a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with _heartbeat(started):
            cfg = preset_config(DEFAULT_PRESET)
            logger.info("[1/2] writing random weights (%d tensors)", len(expected_shapes(cfg)))
            write_checkpoint(staging, cfg, DEFAULT_SEED)
            logger.info("[2/2] training the byte-level tokenizer (vocabulary %d)", cfg.vocab_size)
            train_tokenizer(staging, vocab_size=cfg.vocab_size, seed=DEFAULT_SEED)
        (staging / _COMPLETE).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("default model ready in %.1f s: %s", time.monotonic() - started, target)
    return target


@contextmanager
def _heartbeat(started: float, every_s: float = 5.0) -> Iterator[None]:
    """A log line every `every_s` while the model is generated, so a slow first start never looks hung."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            logger.info("... still generating the default model (%.0f s)", time.monotonic() - started)

    thread = threading.Thread(target=beat, name="default-model-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
