"""The server's configuration tree: server fields at the top, an ``engine:`` section of
``EngineConfig`` fields. Built once at start-up from defaults < file < environment < flags.

File (YAML or JSON)::

    port: 8000
    served_model_name: smollm2
    engine:
      model: /models/SmolLM2-135M-Instruct
      tp: 1

Environment: ``SPLITFUSE_<FIELD>`` for a field (or a short alias) of either level, e.g.
``SPLITFUSE_PORT=9000``, ``SPLITFUSE_MAX_BATCH_TOKENS=1024``, ``SPLITFUSE_API_KEY=k1,k2``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from engine.config import EngineConfig, parse_memory
from server.protocol import MAX_PROMPTS

ENV_PREFIX = "SPLITFUSE_"
_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
# Environment variables with the prefix that are not configuration fields.
_ENV_NOT_FIELDS = {"SPLITFUSE_CACHE"}


class ConfigError(ValueError):
    """An invalid configuration; the message names each bad key and why."""


class ServerConfig(BaseModel):
    """Everything ``splitfuse serve`` needs, validated at start-up and frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    served_model_name: str | None = Field(
        None, description="the name clients send as `model` (default: the model's name)"
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="sequences (each API call's prompts x n) waiting for their first token; a "
        "call that would take the count past this gets 429",
    )
    max_sequences_per_request: int = Field(
        128,
        ge=1,
        le=MAX_PROMPTS,
        description="sequences (prompts x n) one API call may ask for; more get 400 naming the "
        "param. A call is also refused (400) above max_queued_requests, which it could never fit",
    )
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1, description="413 above this ('2MiB')")
    api_key: tuple[str, ...] = Field(
        (), validation_alias=AliasChoices("api_key", "api_keys"), description="accepted keys"
    )
    api_key_file: Path | None = Field(None, description="a file of API keys, one per line")
    drain_timeout: float = Field(
        30.0, ge=0, description="seconds in-flight requests get on SIGTERM"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_require_auth: bool = False
    vllm_metrics: bool = Field(
        True,
        description="also export the vllm:* series that gateways, endpoint pickers and "
        "autoscalers read from vLLM-compatible servers",
    )
    tenant_header: str | None = Field(
        None,
        description="a request header naming the request's tenant (set by a trusted gateway); "
        "otherwise the API key is the tenant",
    )
    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(compile=True, quantization="auto")
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _server_defaults(cls, value: Any) -> Any:
        """A server compiles its step graphs unless told not to (``compile: false``): in the
        background, serving eagerly until they are ready. Its quantization is ``auto`` unless
        given (``engine/quantization.py``: int4 on CPUs that run its product natively)."""
        if isinstance(value, Mapping):
            defaults = {"compile": True, "quantization": "auto"}
            aliases = {"quantization": ("quantization", "quant")}
            for name, default in defaults.items():
                if not any(key in value for key in aliases.get(name, (name,))):
                    value = {**value, name: default}
        return value

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _parse_body_size(cls, value: str | int) -> int:
        parsed = parse_memory(value)
        if not isinstance(parsed, int):
            raise ValueError("must be a size in bytes, e.g. 1048576 or 1MiB")
        return parsed

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
        if isinstance(value, str):
            value = value.split(",")
        keys = tuple(key.strip() for key in value)
        if any(not key for key in keys):
            raise ValueError("API keys must not be empty")
        return keys

    @field_validator("tenant_header")
    @classmethod
    def _check_header_name(cls, value: str | None) -> str | None:
        if value is not None and not _HEADER_NAME.fullmatch(value):
            raise ValueError("must be an HTTP header name such as X-Tenant-Id")
        return value.lower() if value is not None else None

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: str) -> str:
        return value.lower() if isinstance(value, str) else value

    def all_api_keys(self) -> tuple[str, ...]:
        """The keys of ``api_key`` and of ``api_key_file`` (blank lines and # comments skipped)."""
        keys = list(self.api_key)
        if self.api_key_file is not None:
            for line in self.api_key_file.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return tuple(keys)


def _alias_map(model: type[BaseModel]) -> dict[str, str]:
    """Each accepted spelling of a field -> its name (``tp`` -> ``tensor_parallel_size``)."""
    names: dict[str, str] = {}
    for name, info in model.model_fields.items():
        names[name] = name
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str):
                    names[choice] = name
        elif isinstance(alias, str):
            names[alias] = name
    return names


_SERVER_NAMES = {k: v for k, v in _alias_map(ServerConfig).items() if v != "engine"}
_ENGINE_NAMES = _alias_map(EngineConfig)


def _canonical(values: Mapping[str, Any], names: dict[str, str], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"unknown key {where}{key!r}")
        out[names[key]] = value
    return out


def split_levels(values: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """A flat or nested mapping -> ``{server fields..., "engine": {engine fields...}}`` with
    canonical names. Unknown keys raise ``ConfigError`` naming them."""
    server: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for key, value in values.items():
        if key == "engine":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}engine must be a mapping, got {type(value).__name__}")
            engine.update(_canonical(value, _ENGINE_NAMES, f"{where}engine."))
        elif key in _SERVER_NAMES:
            server[_SERVER_NAMES[key]] = value
        elif key in _ENGINE_NAMES:
            engine[_ENGINE_NAMES[key]] = value
        else:
            raise ConfigError(f"unknown key {where}{key!r}")
    server["engine"] = engine
    return server


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file as nested canonical values."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from error
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot parse config file {path}: {error}") from error
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return split_levels(data, where=f"{path.name}: ")


def read_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """``SPLITFUSE_<FIELD>`` variables as nested canonical values (other variables are ignored)."""
    values: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX) or key in _ENV_NOT_FIELDS:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in _SERVER_NAMES or name in _ENGINE_NAMES:
            values[name] = value
    return split_levels(values, where="environment: ")


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **{k: v for k, v in top.items() if k != "engine"}}
    merged["engine"] = {**base.get("engine", {}), **top.get("engine", {})}
    return merged


# Fields whose values never appear in an error message or a log line.
_SECRET_FIELDS = frozenset({"api_key", "api_keys"})


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "config"
        secret = _SECRET_FIELDS.intersection(str(part) for part in item["loc"])
        got = "a value not shown" if secret else repr(item.get("input"))
        lines.append(f"  {where}: {item['msg']} (got {got})")
    return "invalid configuration:\n" + "\n".join(lines)


def load_config(
    flags: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Builds the config with precedence flags > environment > file > defaults.

    ``flags`` holds only the values given on the command line (flat or nested, canonical names or
    aliases). Raises ``ConfigError`` with one line per problem.
    """
    values: dict[str, Any] = {"engine": {}}
    if config_file is not None:
        values = _merge(values, read_config_file(config_file))
    values = _merge(values, read_environment(os.environ if environ is None else environ))
    if flags:
        values = _merge(values, split_levels(flags, where="flag "))
    try:
        config = ServerConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None
    if config.api_key_file is not None and not config.api_key_file.is_file():
        raise ConfigError(
            f"invalid configuration:\n  api_key_file: no such file {config.api_key_file}"
        )
    return config
