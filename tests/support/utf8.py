"""Byte-level checks the tokenizer and logprob tests share."""

from __future__ import annotations


def is_partial_utf8(raw: bytes) -> bool:
    """A token's bytes that are not valid UTF-8 on their own (part of a multi-byte character)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
