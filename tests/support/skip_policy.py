"""Which skipped tests are allowed: a test that skips silently is a test that never runs, so the strict run
(`.ci/run` sets TESSERA_STRICT_SKIPS=1) fails on any skip not listed in tests/skip_allowlist.txt.

The allow-list has one entry per line: a node-id pattern (`*` matches any text, parameters included; every other
character, brackets too, matches itself), then ` -- ` and the reason it may skip. TESSERA_SKIP_ALLOWLIST names
another allow-list file. Blank lines and lines starting with `#` are ignored. The conftest.py
hook collects every skip and calls `unexpected_skips` at the end of the session.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ALLOWLIST = Path(__file__).resolve().parents[1] / "skip_allowlist.txt"
STRICT_ENV = "TESSERA_STRICT_SKIPS"
ALLOWLIST_ENV = "TESSERA_SKIP_ALLOWLIST"


@dataclass(frozen=True)
class AllowedSkip:
    pattern: str
    reason: str

    def matches(self, node_id: str) -> bool:
        regex = ".*".join(re.escape(part) for part in self.pattern.split("*"))
        return re.fullmatch(regex, node_id) is not None


def parse_allowlist(text: str) -> list[AllowedSkip]:
    """Entries of an allow-list; a line without ` -- reason` is an error (every skip must say why)."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition(" -- ")
        if not sep or not pattern.strip() or not reason.strip():
            raise ValueError(f"skip allow-list line {number}: expected 'NODE-ID-PATTERN -- reason', got {line!r}")
        entries.append(AllowedSkip(pattern.strip(), reason.strip()))
    return entries


def load_allowlist(path: Path | None = None) -> list[AllowedSkip]:
    path = path or Path(os.environ.get(ALLOWLIST_ENV, ALLOWLIST))
    return parse_allowlist(path.read_text()) if path.exists() else []


def unexpected_skips(skipped: list[tuple[str, str]], allowed: list[AllowedSkip]) -> list[tuple[str, str]]:
    """The (node id, skip reason) pairs that no allow-list pattern matches."""
    return [(node_id, reason) for node_id, reason in skipped
            if not any(entry.matches(node_id) for entry in allowed)]
