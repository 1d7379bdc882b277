"""Tokenizer behaviour a user sees: text round-trips, streaming text is never broken, special tokens
sit at fixed ids, and training the default tokenizer is reproducible byte for byte."""

from __future__ import annotations

import json
import random

import pytest

from tessera.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tessera.engine.tools.tokenizer_train import SPECIAL_TOKENS, train_tokenizer
from tessera.server.chat_format import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, render_prompt
from tessera.server.dsml import DSML
from tests.support.utf8 import is_partial_utf8

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces \n\n\ttabs\r\n",
    "日本語のテキストと中文字符，还有한국어.",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "combining: e\u0301 n\u0303 ; Arabic: مرحبا بالعالم ; Devanagari: नमस्ते",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q ; zero-width\u200bspace ; NUL \x00 byte",
    "def f(x):\n    return {'a': [1, 2.5, None]}  # code",
    "<｜User｜>special strings inside text<think>reasoning</think>｜DSML｜ stay tokens",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    # A small vocab leaves many characters as several byte tokens: a real test of the detokenizer.
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


# ---- vocabulary ------------------------------------------------------------------------------------


def test_special_tokens_have_fixed_ids(tok):
    assert [tok.id_of(text) for text, _ in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.id_of("<｜begin▁of▁sentence｜>") == 0 and tok.id_of("<｜end▁of▁sentence｜>") == 1
    assert tok.vocab_size == 300


def test_only_control_tokens_are_skipped_on_decode(tok):
    # <think>, </think> and ｜DSML｜ must survive skip_special_tokens, or the output parser goes blind.
    assert tok.special_token_ids == {0, 1, 2, 3}
    text = "<｜User｜>a<think>b</think>c｜DSML｜<｜end▁of▁sentence｜>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "a<think>b</think>c｜DSML｜"


def test_every_marker_of_the_v4_format_is_one_token(tok):
    for marker in (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML):
        assert len(tok.encode(marker)) == 1, marker
    ids = tok.encode(render_prompt([{"role": "user", "content": "hi"}], thinking=True))
    assert ids[0] == tok.bos_token_id
    assert ids[-2:] == [tok.id_of(ASSISTANT), tok.id_of(THINK_START)]


def test_encode_adds_no_bos(tok):
    assert tok.encode("hi")[0] != tok.bos_token_id
    assert tok.encode("") == []


def test_unknown_token_and_id(tok):
    assert tok.id_of("<｜no such token｜>") is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


# ---- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_unicode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_concatenate_to_the_utf8_text(tok, text):
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode("utf-8")


def test_small_vocab_splits_characters_across_tokens(tok):
    """Guards the detokenizer tests below: they only mean something if some tokens are partial characters."""
    ids = tok.encode("🎉你")
    assert any(is_partial_utf8(tok.token_bytes(i)) for i in ids)


# ---- incremental detokenizer ------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_detokenizer_at_every_token_matches_full_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    streamed = ""
    for k, token_id in enumerate(ids, start=1):
        piece = detok.feed(token_id)
        assert "\ufffd" not in piece
        streamed += piece
        # After k tokens we have released exactly the complete characters of those k tokens.
        complete = b"".join(tok.token_bytes(i) for i in ids[:k]).decode("utf-8", errors="ignore")
        assert text.startswith(streamed) and streamed == complete
    assert streamed + detok.flush() == tok.decode(ids) == text


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_detokenizer_equals_decode_on_arbitrary_ids(tok, skip_special_tokens):
    """Random ids include broken UTF-8 and special tokens: still exactly the library's decode."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        streamed = "".join(detok.feed(i) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_flush_releases_an_incomplete_character(tok):
    ids = tok.encode("🎉")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed(i) for i in ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])  # the library's lossy decode: U+FFFD


# ---- training ----------------------------------------------------------------------------------------


def test_training_is_deterministic(tmp_path):
    first = train_tokenizer(tmp_path / "a", vocab_size=300, seed=3)
    second = train_tokenizer(tmp_path / "b", vocab_size=300, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    other_seed = train_tokenizer(tmp_path / "c", vocab_size=300, seed=4)
    assert (other_seed / "tokenizer.json").read_bytes() != (first / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("vocab_size", [264, 1000])
def test_vocab_has_exactly_the_requested_size(tmp_path, vocab_size):
    assert Tokenizer.from_dir(train_tokenizer(tmp_path, vocab_size=vocab_size)).vocab_size == vocab_size


def test_too_small_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must exceed"):
        train_tokenizer(tmp_path, vocab_size=len(SPECIAL_TOKENS) + 256)


def test_trained_config_has_no_chat_template(tokenizer_dir, tok):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in config and tok.chat_template is None
    assert tok.model_max_length == config["model_max_length"]


def test_transformers_loads_the_trained_tokenizer_identically(tokenizer_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    for text in SAMPLES:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)


# ---- loading model dirs ----------------------------------------------------------------------------


def test_chat_template_is_read_from_the_config(tokenizer_dir, tmp_path):
    _copy_tokenizer(tokenizer_dir, tmp_path, config={"bos_token": {"content": BOS}, "chat_template": "{{ bos_token }}"})
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template == "{{ bos_token }}" and loaded.bos_token_id == 0


def test_chat_template_file_and_missing_config(tokenizer_dir, tmp_path):
    _copy_tokenizer(tokenizer_dir, tmp_path, config=None)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}", encoding="utf-8")
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template == "{{ messages }}"
    assert (loaded.bos_token_id, loaded.eos_token_id) == (0, 1)  # DeepSeek's defaults


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _copy_tokenizer(src, dst, config: dict | None) -> None:
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
