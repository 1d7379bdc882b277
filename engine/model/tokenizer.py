"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer`, plus a pure-python incremental detokenizer.

DeepSeek's tokenizers are byte-level BPE (GPT-2 style): every token is a run of raw bytes, spelled in
`tokenizer.json` with the printable stand-in characters of `bytes_to_unicode()`. That lets us recover
a token's exact bytes (OpenAI logprobs `bytes`) and detokenize a stream byte by byte without ever
splitting a multi-byte UTF-8 character.

No model, no MLX: the server uses this on the asyncio side.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

# The DeepSeek defaults, used when a model dir has no tokenizer_config.json (fullwidth ｜, U+2581 ▁).
DEFAULT_BOS_TOKEN = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS_TOKEN = "<｜end▁of▁sentence｜>"

# HF writes this sentinel for "no limit" (int(1e30)); anything this large means unset.
_UNSET_MAX_LENGTH = 2**62


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


class TooManyTokens(ValueError):
    """A text longer than the `max_tokens` its caller can use (Tokenizer.encode)."""

    def __init__(self, num_tokens: int, max_tokens: int) -> None:
        super().__init__(f"the text has {num_tokens} tokens, more than {max_tokens}")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class Tokenizer:
    """A model's tokenizer: encode/decode, special-token ids, and per-token raw bytes."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = DEFAULT_BOS_TOKEN,
        eos_token: str | None = DEFAULT_EOS_TOKEN,
        chat_template: str | None = None,
        model_max_length: int | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token if bos_token is not None and backend.token_to_id(bos_token) is not None else None
        self.eos_token = eos_token if eos_token is not None and backend.token_to_id(eos_token) is not None else None
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and, when present, `tokenizer_config.json` / `chat_template.jinja`."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        chat_template = _pick_chat_template(config.get("chat_template"))
        template_file = path / "chat_template.jinja"  # newer transformers save the template beside the config
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        max_length = config.get("model_max_length")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token", DEFAULT_BOS_TOKEN)),
            eos_token=_token_content(config.get("eos_token", DEFAULT_EOS_TOKEN)),
            chat_template=chat_template,
            model_max_length=int(max_length)
            if isinstance(max_length, (int, float)) and max_length < _UNSET_MAX_LENGTH
            else None,
        )

    # ---- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. No BOS is added; special-token strings in the text become their ids.

        `encode_batch_fast` (the same ids as `encode`, without character offsets) releases the GIL while it
        runs; `encode` holds it — 9 s for a 10 MB prompt, during which no other Python thread (the server's
        event loop) could run. `max_tokens`: raise TooManyTokens past it, before building the Python list of
        ids (itself ~90 ms with the GIL held for 3.6M tokens)."""
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=False)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding), max_tokens)
        return encoding.ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        self._require_byte_level()
        # Same rule as the tokenizers ByteLevel decoder: a token spelled entirely in the byte alphabet
        # maps char -> byte; anything else (added tokens like <｜User｜>) is its own UTF-8 text.
        if all(c in _CHAR_TO_BYTE for c in token):
            raw = bytes(_CHAR_TO_BYTE[c] for c in token)
        else:
            raw = token.encode("utf-8")
        self._token_bytes[token_id] = raw
        return raw

    def backend_json(self) -> str:
        """The whole `tokenizers` spec as JSON (what grammar engines such as llguidance build masks from)."""
        return self._backend.to_str()

    # ---- vocabulary facts -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.id_of(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.id_of(self.eos_token) if self.eos_token is not None else None

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of control tokens: the ones `decode(..., skip_special_tokens=True)` leaves out."""
        return frozenset(i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special)

    def id_of(self, token: str) -> int | None:
        """The id of one vocabulary entry spelled exactly `token` (byte-level spelling), or None."""
        return self._backend.token_to_id(token)

    def _require_byte_level(self) -> None:
        if not isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel):
            kind = type(self._backend.decoder).__name__ if self._backend.decoder is not None else "none"
            raise NotImplementedError(
                "token bytes need a byte-level BPE tokenizer (decoder ByteLevel, as DeepSeek's); "
                f"this one's decoder is {kind}"
            )


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> str | None:
    """HF allows one template string or a list of named ones; we serve the default (or the first)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
        return template if isinstance(template, str) else None
    return None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, releasing only complete characters.

    Feeding ids one by one and concatenating every return value plus `flush()` equals
    `tokenizer.decode(ids)`. A character split across tokens is held back until its last byte
    arrives, so streamed text never contains a U+FFFD that the full decode would not have.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # errors="replace" mirrors the tokenizers decoder (lossy UTF-8) for truly invalid byte runs.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", or more than one character)."""
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever bytes are still pending (an incomplete character decodes as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
