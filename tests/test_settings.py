"""Settings: TOML < TESSERA_* env < CLI flags; byte sizes; the tile <= chunk rule; the CLI's error output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from tessera.server.cli import build_parser, main, settings_from_args
from tessera.server.settings import DEFAULT_CONFIG_FILE, Settings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TESSERA_"):
            monkeypatch.delenv(name)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tessera.toml"
    path.write_text('port = 1111\nprefill_chunk = 2048\nindexer_tile = 512\nmemory_budget = "2GiB"\n')
    return path


def _serve_args(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_default_toml_matches_schema_defaults() -> None:
    assert DEFAULT_CONFIG_FILE.is_file()
    assert load_settings() == Settings()


def test_precedence_toml_env_cli(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_toml = _serve_args("--config", str(config_file))
    assert (from_toml.port, from_toml.prefill_chunk, from_toml.memory_budget) == (1111, 2048, 2 * 2**30)

    monkeypatch.setenv("TESSERA_PORT", "2222")
    monkeypatch.setenv("TESSERA_INDEXER_TILE", "256")
    from_env = _serve_args("--config", str(config_file))
    assert (from_env.port, from_env.indexer_tile, from_env.prefill_chunk) == (2222, 256, 2048)

    from_cli = _serve_args("--config", str(config_file), "--port", "3333", "--memory-budget", "512MiB")
    assert (from_cli.port, from_cli.indexer_tile, from_cli.memory_budget) == (3333, 256, 512 * 2**20)


def test_config_file_from_env(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_CONFIG", str(config_file))
    assert load_settings().port == 1111


def test_cli_flags_cover_every_field(tmp_path: Path) -> None:
    settings = _serve_args(
        "--host", "0.0.0.0", "--model", str(tmp_path), "--served-model-name", "v4", "--max-context", "8192",
        "--api-key", "k1", "--api-key", "k2", "--max-num-seqs", "4", "--max-queued-requests", "0",
        "--max-body-bytes", "1MiB", "--metrics-vllm-aliases", "--shutdown-timeout-s", "2.5", "--log-level", "DEBUG",
    )
    assert settings.host == "0.0.0.0" and settings.model == tmp_path and settings.served_model_name == "v4"
    assert settings.max_context == 8192 and settings.api_keys == ["k1", "k2"]
    assert (settings.max_num_seqs, settings.max_queued_requests, settings.max_body_bytes) == (4, 0, 2**20)
    assert settings.metrics_vllm_aliases is True and settings.shutdown_timeout_s == 2.5
    assert settings.log_level == "debug"


def test_weights_dtype_from_flag_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().weights_dtype is None  # default: compute on the quantized weights
    assert _serve_args("--weights-dtype", "bfloat16").weights_dtype == "bfloat16"
    toml = tmp_path / "t.toml"
    toml.write_text('weights_dtype = "float32"\n')
    assert _serve_args("--config", str(toml)).weights_dtype == "float32"
    monkeypatch.setenv("TESSERA_WEIGHTS_DTYPE", "bfloat16")
    assert load_settings(toml).weights_dtype == "bfloat16"


def test_bad_weights_dtype_is_reported_with_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--weights-dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "weights_dtype (--weights-dtype)" in err and "'bfloat16' or 'float32'" in err
    assert main(["serve", "--weights-dtype", "bfloat16", "--world", "2"]) == 2
    assert "weights_dtype is not supported with world > 1" in capsys.readouterr().err


def test_env_api_keys_comma_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_API_KEYS", "a, b")
    assert load_settings().api_keys == ["a", "b"]
    monkeypatch.setenv("TESSERA_API_KEYS", '["c"]')
    assert load_settings().api_keys == ["c"]
    assert load_settings().public_dict()["api_keys"] == ["<1 redacted>"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100GiB", 100 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("64 KiB", 64 * 1024),
        ("4096", 4096),
        ("10b", 10),
        (4096, 4096),
    ],
)
def test_memory_sizes(text: str | int, expected: int) -> None:
    assert Settings(memory_budget=text).memory_budget == expected
    assert Settings(max_body_bytes=text).max_body_bytes == expected


@pytest.mark.parametrize("text", ["lots", "10XB", "-1GiB", "0", "GiB", True])
def test_bad_memory_sizes(text: str | bool) -> None:
    with pytest.raises(ValidationError, match="memory_budget"):
        Settings(memory_budget=text)


def test_tile_larger_than_chunk_is_an_error() -> None:
    with pytest.raises(ValidationError, match=r"indexer_tile \(2048\) must be ≤ prefill_chunk \(1024\)"):
        Settings(prefill_chunk=1024, indexer_tile=2048)
    assert Settings(prefill_chunk=1024, indexer_tile=1024).indexer_tile == 1024


def test_cli_reports_invalid_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--prefill-chunk", "512", "--indexer-tile", "1024"]) == 2
    err = capsys.readouterr().err
    assert "indexer_tile (1024) must be ≤ prefill_chunk (512)" in err and "--indexer-tile" in err

    assert main(["serve", "--port", "http"]) == 2
    assert "port (--port)" in capsys.readouterr().err


def test_unknown_toml_key_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("prefil_chunk = 10\n")
    with pytest.raises(ValidationError, match="prefil_chunk"):
        load_settings(bad)
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        load_settings(tmp_path / "missing.toml")


def test_serve_help_shows_every_setting_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    # A '%' in a description must not reach argparse's %-formatting (it would dump its internals).
    assert "7 % slower prefill" in text and "option_strings" not in text
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text or name == "api_keys"


def test_a_prefix_cache_larger_than_the_budget_is_an_error_naming_both_flags() -> None:
    with pytest.raises(ValidationError, match="--prefix-cache-bytes or raise --memory-budget"):
        Settings(memory_budget="1GiB", prefix_cache_bytes="2GiB")
    assert Settings(memory_budget="1GiB", prefix_cache_bytes="2GiB", prefix_cache=False).prefix_cache is False
    assert Settings(memory_budget="4GiB", prefix_cache_bytes="1GiB").prefix_cache_bytes == 2**30
