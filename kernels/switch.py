"""On/off switches read once from an environment variable and flippable in a running process (the
benchmarks' A B B A comparisons of compiled vs plain paths, kernel vs reference)."""

from __future__ import annotations

import os


class Switch:
    """`NAME=0|1` in the environment (absent: `default`); any other value is an error at start-up."""

    def __init__(self, env_var: str, default: bool = True) -> None:
        self.env_var = env_var
        value = os.environ.get(env_var, "1" if default else "0")
        if value not in ("0", "1"):
            raise ValueError(f"{env_var} must be 0 (off) or 1 (on), got {value!r}")
        self._enabled = value == "1"

    def enabled(self) -> bool:
        return self._enabled

    def set(self, enabled: bool) -> None:
        """Takes effect on the next graph built."""
        self._enabled = bool(enabled)
