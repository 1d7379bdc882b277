"""The tiny checkpoint the tiling, chunking and bench tests share: small enough for seconds-fast runs,
shaped so a 403-token run crosses every boundary the tiling invariants are about."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.engine.model.attention import PROJECTION_ROWS
from tessera.engine.model.config import CSA, HCA, WINDOW
from tessera.engine.model.loader import load_model
from tessera.engine.tools.make_model import make_model

# top-k 16 of up to ~100 visible rows; HCA ratio 32 so a 400-token run crosses 12 of its
# boundaries and 100 of the ratio-4 ones; window 16.
OVERRIDES = dict(layer_types=[WINDOW, CSA, HCA, CSA], num_hidden_layers=4, compress_rates={CSA: 4, HCA: 32})
CTX = 403
# A chunk longer than one projection block, so tiles straddle the blocks' boundaries.
CHUNK = PROJECTION_ROWS + 64


def make_tiling_model(directory: Path, seed: int = 11) -> Path:
    return make_model(directory, "tiny", seed=seed, with_tokenizer=False, **OVERRIDES)


# The fixtures of the modules that test on this checkpoint: `from tests.support.tiling_model import model, model_dir`.
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiling_model(tmp_path_factory.mktemp("tiling"))


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir, dtype="float32")
