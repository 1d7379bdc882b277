"""Engine-side CLI subcommands (make-model, check, plan, bench). `server/cli.py` owns the entry point."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the engine's subcommands; each sets `func(args) -> int` as its handler."""
