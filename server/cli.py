"""`tessera`: the one console script. `serve` lives here; the engine's subcommands come from tessera.engine.tools.commands.

`serve`'s flags are generated from the Settings schema (one flag per field, its description as help), so
the CLI cannot drift from the settings. Only flags actually given become overrides: an absent flag leaves
the value to the TOML file and `TESSERA_*` variables (precedence in server/settings.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from pydantic import ValidationError

from tessera.engine.tools import commands
from tessera.server.settings import Settings, load_settings

# Fields whose flag is spelled differently from the field name.
_FLAG_NAMES = {"api_keys": "--api-key"}


def _flag(field_name: str) -> str:
    return _FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        description = (field.description or "").replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": description}
        if field.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif name == "api_keys":
            kwargs.update(action="append", metavar="KEY", help=f"{description} Repeat for several keys.")
        else:
            kwargs["metavar"] = name.upper()
        parser.add_argument(_flag(name), **kwargs)  # values stay strings: Settings validates and converts


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Run the OpenAI-compatible HTTP server. Settings: config/default.toml (or --config) < "
        "TESSERA_* environment variables < these flags.",
    )
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML settings file (default: $TESSERA_CONFIG, else config/default.toml)")
    _add_settings_flags(parser)
    parser.set_defaults(func=_serve)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The effective settings for `serve`'s parsed flags (only the flags given override)."""
    overrides = {name: getattr(args, name) for name in Settings.model_fields if hasattr(args, name)}
    return load_settings(args.config, **overrides)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        print(f"tessera serve: invalid settings:\n{_describe(exc)}", file=sys.stderr)
        return 2
    from tessera.server.serve import serve  # uvicorn and the app only once the settings are good

    return serve(settings)


def _describe(exc: Exception) -> str:
    """A validation error as 'field (--flag): message' lines, naming the flag a user can change."""
    if not isinstance(exc, ValidationError):
        return f"  {exc}"
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error.get("loc") else ""
        where = f"{name} ({_flag(name)}): " if name else ""
        lines.append(f"  {where}{str(error['msg']).removeprefix('Value error, ')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera: DeepSeek-V4 inference on MLX.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_serve(subparsers)
    commands.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
