"""The server configuration tree: sources, precedence, aliases and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.config import ConfigError, ServerConfig, load_config
from server.protocol import MAX_PROMPTS
from server.serve_command import flags_from_args


def _parse(argv: list[str]) -> dict:
    from server.cli import build_parser

    return flags_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults() -> None:
    config = load_config(environ={})
    assert config.host == "127.0.0.1"
    assert config.port == 8000
    assert config.drain_timeout == 30
    assert config.api_key == ()
    assert config.engine.model == "SmolLM2-135M-Instruct"


def test_the_server_compiles_unless_told_not_to() -> None:
    assert load_config(environ={}).engine.compile is True
    assert ServerConfig().engine.compile is True
    assert ServerConfig(engine={"dtype": "float32"}).engine.compile is True
    assert ServerConfig(engine={"compile": False}).engine.compile is False
    assert load_config(environ={"SPLITFUSE_COMPILE": "false"}).engine.compile is False
    assert load_config(_parse(["--no-compile"]), environ={}).engine.compile is False
    assert _parse([]) == {}


def test_yaml_file_with_engine_section_and_aliases(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(
        "host: 0.0.0.0\nport: 8001\nserved_model_name: smollm2\nmax_queued_requests: 4\n"
        "drain_timeout: 5\nengine:\n  model: /models/x\n  dtype: bfloat16\n"
        "  max_batch_tokens: 256\n  tp: 1\n"
    )
    config = load_config(config_file=path, environ={})
    assert (config.host, config.port, config.served_model_name) == ("0.0.0.0", 8001, "smollm2")
    assert config.max_queued_requests == 4
    assert config.engine.model == "/models/x"
    assert config.engine.dtype == "bfloat16"
    assert config.engine.max_batch_tokens == 256
    assert config.engine.tensor_parallel_size == 1


def test_json_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"port": 9000, "engine": {"max_num_seqs": 7}}))
    config = load_config(config_file=path, environ={})
    assert config.port == 9000
    assert config.engine.max_batch_seqs == 7


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 1111\nmax_queued_requests: 3\nengine:\n  max_batch_tokens: 64\n")
    environ = {"SPLITFUSE_PORT": "2222", "SPLITFUSE_MAX_BATCH_TOKENS": "128"}
    config = load_config(flags={"port": 3333}, config_file=path, environ=environ)
    assert config.port == 3333
    assert config.engine.max_batch_tokens == 128
    assert config.max_queued_requests == 3


def test_environment_fields_of_both_levels() -> None:
    environ = {
        "SPLITFUSE_API_KEY": "k1, k2",
        "SPLITFUSE_TP": "1",
        "SPLITFUSE_KV_CACHE_MEMORY": "2GiB",
        "SPLITFUSE_METRICS_REQUIRE_AUTH": "true",
        "SPLITFUSE_CACHE": "/somewhere",  # the model cache, not a field
        "OTHER": "x",
    }
    config = load_config(environ=environ)
    assert config.api_key == ("k1", "k2")
    assert config.engine.kv_cache_memory == 2 * 1024**3
    assert config.metrics_require_auth is True


def test_cli_flags_map_to_fields() -> None:
    flags = _parse(
        ["/m", "--host", "0.0.0.0", "--tp", "1", "--api-key", "a", "--api-key", "b",
         "--max-body-bytes", "1MiB", "--drain-timeout", "2.5", "--no-prefix-caching",
         "--metrics-require-auth", "--max-batch-tokens", "64", "--kv-cache-dtype", "float16"]
    )  # fmt: skip
    config = load_config(flags=flags, environ={})
    assert config.engine.model == "/m"
    assert config.engine.kv_cache_dtype == "float16"
    fp8 = load_config(flags=_parse(["/m", "--kv-cache-dtype", "fp8"]), environ={})
    assert fp8.engine.kv_cache_dtype == "fp8"
    assert config.api_key == ("a", "b")
    assert config.max_body_bytes == 1024 * 1024
    assert config.drain_timeout == 2.5
    assert config.engine.enable_prefix_caching is False
    assert config.engine.tensor_parallel_size == 1
    assert config.engine.max_batch_tokens == 64
    assert config.metrics_require_auth is True
    assert _parse([]) == {}


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("port: 1\nbogus: 2\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_config(config_file=path, environ={})
    path.write_text("engine:\n  max_batch_tokenz: 2\n")
    with pytest.raises(ConfigError, match="engine.'max_batch_tokenz'"):
        load_config(config_file=path, environ={})


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"port": 70000}, "port"),
        ({"max_batch_tokens": 0}, "engine.max_batch_tokens"),
        ({"dtype": "int3"}, "engine.dtype"),
        ({"kv_cache_dtype": "int8"}, "engine.kv_cache_dtype"),
        ({"kv_cache_memory": "lots"}, "engine.kv_cache_memory"),
        ({"max_body_bytes": "big"}, "max_body_bytes"),
        ({"log_level": "loud"}, "log_level"),
        ({"api_key": ["a", ""]}, "api_key"),
    ],
)
def test_invalid_values_say_where(flags: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(flags=flags, environ={})


def test_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(config_file=tmp_path / "missing.yaml", environ={})
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(config_file=path, environ={})


def test_api_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nkey-one\n\nkey-two\n")
    config = load_config(flags={"api_key": ["flag-key"], "api_key_file": str(path)}, environ={})
    assert config.all_api_keys() == ("flag-key", "key-one", "key-two")
    with pytest.raises(ConfigError, match="api_key_file"):
        load_config(flags={"api_key_file": str(tmp_path / "none")}, environ={})


def test_config_is_frozen() -> None:
    config = ServerConfig()
    with pytest.raises(ValueError):
        config.port = 1  # type: ignore[misc]


def test_max_sequences_per_request_from_each_source(tmp_path: Path) -> None:
    assert load_config(environ={}).max_sequences_per_request == 128
    environ = {"SPLITFUSE_MAX_SEQUENCES_PER_REQUEST": "16"}
    assert load_config(environ=environ).max_sequences_per_request == 16
    path = tmp_path / "serve.yaml"
    path.write_text("max_sequences_per_request: 512\n")
    assert load_config(config_file=path, environ={}).max_sequences_per_request == 512
    description = ServerConfig.model_fields["max_sequences_per_request"].description
    assert description is not None and "prompts x n" in description
    for bad in (0, MAX_PROMPTS + 1):
        with pytest.raises(ConfigError, match="max_sequences_per_request"):
            load_config(flags={"max_sequences_per_request": bad}, environ={})
