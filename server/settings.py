"""The one settings schema of `tessera serve` (README.md lists every setting).

Sources, lowest precedence first: `config/default.toml` (or the file given by `--config` / `TESSERA_CONFIG`),
`TESSERA_*` environment variables, CLI flags. The CLI is parsed at the edge (server/cli.py) into keyword
overrides; nothing past this module sees argparse or the environment.
"""

from __future__ import annotations

import json
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[1] / "config" / "default.toml"
CONFIG_ENV_VAR = "TESSERA_CONFIG"

# Which TOML file the next `Settings()` reads; set only by `load_settings` (pydantic-settings builds its
# sources in a classmethod, so the chosen file has to reach it from outside the constructor).
_config_file: ContextVar[Path | None] = ContextVar("tessera_config_file", default=None)

def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic.ByteSize would read True as 1 byte
        raise ValueError("a byte size must be a number or a string like '100GiB', not a boolean")
    return value


def _positive_bytes(value: int) -> int:
    if value <= 0:
        raise ValueError(f"a byte size must be positive, got {value}")
    return int(value)


def _parse_api_keys(value: Any) -> Any:
    """One item, `"k1,k2"`, or a JSON list (the form an env var can carry) -> list (API keys, CORS origins)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [key.strip() for key in text.split(",") if key.strip()]
    return value


# `"100GiB"`, `"512MiB"`, `"2GB"`, `"1.5GiB"`, `"4096"` or an int -> bytes, by pydantic's own ByteSize: binary
# units (KiB … TiB) are powers of 1024, decimal ones (KB … TB) of 1000.
ByteSize = Annotated[pydantic.ByteSize, BeforeValidator(_not_a_boolean), AfterValidator(_positive_bytes)]


class Settings(BaseSettings):
    """Everything `tessera serve` can be told. Frozen: built once at start, then only read."""

    model_config = SettingsConfigDict(
        env_prefix="TESSERA_",
        extra="forbid",  # a typo in the TOML file is an error, not a silently ignored key
        frozen=True,
    )

    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 exposes the server to the network.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: any free port).")
    model: Path | None = Field(
        None,
        description="Model directory (config.json + safetensors + tokenizer.json). None: the embedded default "
        "model, a small random-weight V4 checkpoint generated on first start.",
    )
    served_model_name: str | None = Field(
        None,
        description="The model id clients send and /v1/models lists. None: the model directory's name "
        "(`tessera-default` for the embedded model).",
    )
    weights_dtype: Literal["bfloat16", "float32"] | None = Field(
        None,
        description="Dequantize a quantized checkpoint's weights (the official FP8/FP4 format, `tessera convert`'s "
        "affine/mxfp4) to this dtype at load, for debugging: every projection then runs a plain matmul on float "
        "weights, at 2-4x the weight memory (on the CPU, which computes in float32, they are held in float32). None: keep them quantized and compute on them (quantized_matmul, gather_qmm). A float "
        "checkpoint is unaffected.",
    )
    prefill_chunk: int = Field(
        4096, ge=1, description="Global prefill chunk C in tokens, also the scheduler's per-step token budget."
    )
    indexer_tile: int = Field(
        1024, ge=1, description="Lightning-indexer query-row tile T (≤ prefill_chunk); bounds the T×N score scratch."
    )
    stage_timing_interval: int = Field(
        16,
        ge=0,
        description="Time the prefill stages (tessera_prefill_stage_seconds) on one prefill step in this many. "
        "A timed step syncs at every stage boundary, which on a GPU idles it while the next ops are built "
        "(measured on an H200 at 1M context, chunk 4096, tile 1024: 7 % slower prefill when every step is "
        "timed). 1: every prefill step; 0: never.",
    )
    max_context: int | None = Field(
        None, ge=1, description="Longest prompt + completion in tokens. None: the model's max_position_embeddings."
    )
    memory_budget: ByteSize | None = Field(
        None,
        description="Memory Tessera may use, e.g. '100GiB', '512MiB' or a byte count: weights + planned prefill "
        "workspace + the KV caches of admitted requests. A request is admitted only if its cache at its maximum "
        "length fits in what weights and workspace leave. None: memory_fraction of the device's memory.",
    )
    memory_fraction: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Without memory_budget, the budget is this fraction of the device's memory: what MLX reports "
        "as the GPU's (unified) memory, or the machine's RAM on the CPU. Like vLLM's gpu_memory_utilization.",
    )
    prefix_cache: bool = Field(
        True,
        description="Keep the state of recent sequences at 128-token block boundaries, so a prompt that starts "
        "with one (a conversation's next turn, a shared system prompt) prefills only the rest. Outputs are "
        "identical with and without it.",
    )
    prefix_cache_bytes: ByteSize | None = Field(
        None,
        description="Most bytes the prefix cache holds, least recently used state evicted first, e.g. '8GiB'. "
        "They come out of memory_budget: requests are admitted against what is left. None: a quarter of what "
        "the memory budget (memory_budget, or memory_fraction of the device) leaves for caches.",
    )
    decode_overlap: bool = Field(
        True,
        description="Queue each decode step's likely successor on the device before reading its tokens, so "
        "building one step's graph overlaps running the other (vLLM's async scheduling). Outputs are identical "
        "with and without it; a step whose plan changes (a request ends or arrives) is undone and costs device "
        "time. A step with a structured-output (grammar) request runs one step at a time. world 1 only.",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted bearer keys for inference routes; empty: no authentication. "
        "CLI: --api-key repeated; env: TESSERA_API_KEYS='k1,k2'.",
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"],
        description="CORS: origins browsers may call from (vLLM's --allowed-origins, same default: any). A JSON "
        "list or comma-separated; empty: no CORS headers. Preflight OPTIONS requests are answered before the "
        "API-key check (browsers never send credentials on a preflight).",
    )
    world: int = Field(
        1,
        ge=1,
        description="Processes the model's layers are split over (pipeline parallel, docs/PARALLEL.md): rank 0 serves "
        "HTTP and runs the first layers, ranks 1…N-1 start on this machine and run the rest (one GPU each with "
        "NCCL on CUDA, the ring backend on 127.0.0.1 otherwise); under `mlx.launch` every rank runs `tessera serve` "
        "and rank 0 serves. 1: one process.",
    )
    max_num_seqs: int = Field(16, ge=1, description="Most requests decoding at once (the running batch).")
    max_queued_requests: int = Field(
        256, ge=0, description="Most requests waiting for admission; beyond it a request gets 503 + Retry-After."
    )
    max_body_bytes: ByteSize = Field(
        16 * 2**20,
        description="Largest request body; larger gets 413. Fits a 1M-token prompt and no more: 2^20 token ids "
        "as JSON are at most ~9.5 MB, 2^20 tokens of text ~4-8 MB.",
    )
    default_max_tokens: int = Field(
        8192,
        ge=0,
        description="Completion cap for chat requests that send no max_tokens / max_completion_tokens (still "
        "limited by the context). 0: the rest of the context (can mean minutes of output).",
    )
    max_stop_strings: int = Field(16, ge=1, description="Most `stop` strings one request may send (400 beyond).")
    max_stop_string_chars: int = Field(1024, ge=1, description="Longest `stop` string in characters (400 beyond).")
    edge_workers: int = Field(
        4,
        ge=1,
        description="Threads that parse request bodies and tokenize prompts off the event loop, so one huge "
        "request never stalls /health or the streams of others; more requests wait for a free one.",
    )
    metrics_vllm_aliases: bool = Field(
        False, description="Also export `vllm:`-named metric aliases so vLLM Grafana dashboards work unchanged."
    )
    shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may finish before they are aborted."
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="Log level of Tessera and uvicorn."
    )

    @field_validator("api_keys", "allowed_origins", mode="before")
    @classmethod
    def _split_lists(cls, value: Any) -> Any:
        return _parse_api_keys(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _tile_fits_chunk(self) -> Settings:
        if self.indexer_tile > self.prefill_chunk:
            raise ValueError(
                f"indexer_tile ({self.indexer_tile}) must be ≤ prefill_chunk ({self.prefill_chunk}): "
                "lower --indexer-tile or raise --prefill-chunk"
            )
        return self

    @model_validator(mode="after")
    def _weights_dtype_on_one_process(self) -> Settings:
        if self.weights_dtype is not None and self.world > 1:
            raise ValueError(
                "weights_dtype is not supported with world > 1 yet (the pipeline ranks load quantized): "
                "drop --weights-dtype or use --world 1"
            )
        return self

    @model_validator(mode="after")
    def _prefix_cache_fits_budget(self) -> Settings:
        # The whole check (against what weights and workspace leave) needs the model: engine/serving/factory.py.
        requested, budget = self.prefix_cache_bytes, self.memory_budget
        if self.prefix_cache and budget and requested and requested >= budget:
            raise ValueError(
                f"prefix_cache_bytes ({requested}) must be less than memory_budget ({budget}): "
                "the prefix cache is part of the budget; lower --prefix-cache-bytes or raise --memory-budget"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: CLI overrides (init kwargs) > TESSERA_* env > TOML file.
        toml_file = _config_file.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    def public_dict(self) -> dict[str, Any]:
        """The effective settings for logs and the info metric: API keys redacted, paths as strings."""
        values = self.model_dump(mode="json")
        values["api_keys"] = [f"<{len(self.api_keys)} redacted>"] if self.api_keys else []
        return values


def resolve_config_file(config_file: Path | str | None) -> Path | None:
    """`--config` > `TESSERA_CONFIG` > config/default.toml (when present). An explicit file must exist."""
    explicit = config_file or os.environ.get(CONFIG_ENV_VAR)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path} (from --config or {CONFIG_ENV_VAR})")
        return path
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Build the effective settings: TOML < `TESSERA_*` env < `overrides` (the CLI flags that were given)."""
    token = _config_file.set(resolve_config_file(config_file))
    try:
        return Settings(**overrides)
    finally:
        _config_file.reset(token)
