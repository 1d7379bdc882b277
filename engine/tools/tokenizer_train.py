"""Train the embedded default's tokenizer: a small byte-level BPE with DeepSeek-V4's special tokens.

Used by the random-weight default model (README.md), so it must work offline and be reproducible:
the corpus is the Python standard library's own source (always installed), picked as a seeded sample
of a sorted file list, and the output files are byte-identical for the same inputs (same Python
stdlib, vocab size and seed).
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tessera.engine.model.tokenizer import DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKEN

# Fixed ids at the start of the vocabulary: (text, is_special). Special tokens are control tokens
# that `skip_special_tokens` drops; <think>, </think> and ｜DSML｜ are not, so reasoning and tool-call
# markup survive a skip-special decode and the output parser (server/dsml.py) still sees them.
# These are the tokens the V4 prompt format (server/chat_format.py) writes; ｜ is U+FF5C, ▁ is U+2581.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (DEFAULT_BOS_TOKEN, True),  # id 0
    (DEFAULT_EOS_TOKEN, True),  # id 1
    ("<｜User｜>", True),  # id 2
    ("<｜Assistant｜>", True),  # id 3
    ("<think>", False),  # id 4
    ("</think>", False),  # id 5
    ("｜DSML｜", False),  # id 6
)

DEFAULT_MODEL_MAX_LENGTH = 1_048_576  # V4's positions

# Characters of training text per vocabulary entry (at least _MIN_CORPUS_CHARS): enough distinct words
# for every merge, and about a second of training for a 2k vocab on two cores.
_CORPUS_CHARS_PER_ENTRY = 400
_MIN_CORPUS_CHARS = 2_000_000


def train_tokenizer(
    out_dir: Path, vocab_size: int = 2048, seed: int = 0, *, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    pad: bool = False,
) -> Path:
    """Train a byte-level BPE of exactly `vocab_size` entries; write tokenizer(_config).json; return out_dir.

    pad: where the offline corpus supports fewer merges than asked (V4 Flash's 129,280 entries: ~122k),
    fill the rest with `<｜reserved_K｜>` tokens (not special: they decode to their text), so every id a
    model of that vocabulary samples has a text — a random-weights model samples all of them."""
    min_size = len(SPECIAL_TOKENS) + 256
    if vocab_size <= min_size:
        raise ValueError(f"vocab_size must exceed {min_size} (special tokens + 256 byte tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(text, special=True, normalized=False) for text, _ in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text round-trips
        min_frequency=0,
        show_progress=False,
    )
    texts = _corpus(seed, max(_MIN_CORPUS_CHARS, _CORPUS_CHARS_PER_ENTRY * vocab_size))
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if pad and missing > 0:
        tokenizer.add_tokens([AddedToken(f"<｜reserved_{k}｜>", special=False, normalized=False) for k in range(missing)])
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(
            f"the offline corpus only supports {tokenizer.get_vocab_size()} entries; ask for a smaller vocab_size"
        )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "tokenizer.json", _with_special_flags(json.loads(tokenizer.to_str())))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(model_max_length))
    return out_dir


def _corpus(seed: int, num_chars: int) -> list[str]:
    """A seeded sample of the stdlib's modules: sorted first, so only the seed picks."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.relative_to(stdlib).parts)
    if not files:
        raise FileNotFoundError(f"no Python sources under {stdlib} to train a tokenizer on")
    random.Random(seed).shuffle(files)
    texts: list[str] = []
    total = 0
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= num_chars:
            break
    return texts


def _with_special_flags(spec: dict) -> dict:
    """The trainer registers every reserved token as special; clear the flag where V4 does not skip it."""
    flags = dict(SPECIAL_TOKENS)
    for entry in spec["added_tokens"]:
        entry["special"] = flags.get(entry["content"], False)  # padding tokens (pad=True) are not special
    return spec


def _tokenizer_config(model_max_length: int) -> dict:
    return {
        "bos_token": DEFAULT_BOS_TOKEN,
        "eos_token": DEFAULT_EOS_TOKEN,
        "pad_token": DEFAULT_EOS_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_bytes((json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))
