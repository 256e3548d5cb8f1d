"""The quantization setting: its accepted forms (a method name, our fields, DeepSpeed's nested
``quant``), what is refused at start-up and how, what ``auto`` resolves to, and how the server
and its flags set it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.config import EngineConfig, QuantizationConfig
from engine.quantization import resolve_quantization
from kernels.cpu_ops import load
from server.config import ServerConfig, load_config
from server.serve_command import flags_from_args


@pytest.mark.parametrize(
    "given,method,group_size",
    [
        (None, "none", None),
        ("int4", "int4", 32),
        ("int8", "int8", None),
        ({"method": "int4", "group_size": 128}, "int4", 128),
        ({"method": "int8", "group_size": 64}, "int8", 64),
        (
            {"enabled": True, "weight": {"num_bits": 4, "group_size": 64, "symmetric": False}},
            "int4",
            64,
        ),
        ({"enabled": True, "weight": {"num_bits": 8}}, "int8", None),
        ({"enabled": False, "weight": {"num_bits": 4}}, "none", None),
    ],
)
def test_accepted_forms(given, method, group_size):
    config = QuantizationConfig.model_validate(given)
    assert (config.method, config.group_size) == (method, group_size)
    assert EngineConfig(quant=given).quantization == config  # DeepSpeed's field name too


@pytest.mark.parametrize(
    "given,needle",
    [
        ({"method": "int4", "group_size": 48}, "group_size 48 is not supported for int4"),
        ({"method": "int8", "group_size": 16}, "group_size 16 is not supported for int8"),
        ({"method": "none", "group_size": 32}, "group_size means nothing"),
        ("int3", "Input should be 'none', 'auto', 'int8' or 'int4'"),
        ({"enabled": True, "weight": {"num_bits": 4, "symmetric": True}}, "asymmetric"),
        ({"enabled": True, "weight": {"num_bits": 8, "symmetric": False}}, "symmetric"),
        ({"enabled": True, "weight": {"num_bits": 3}}, "num_bits must be 4 or 8"),
        ({"enabled": True, "activation": {}}, "unsupported quant field(s): activation"),
        ({"enabled": True, "weight": {"q_type": "x"}}, "unsupported quant.weight field(s): q_type"),
    ],
)
def test_unsupported_combinations_are_refused_naming_them(given, needle):
    with pytest.raises(ValidationError, match="quantization") as refused:
        EngineConfig(quantization=given)
    assert needle in str(refused.value)


def test_auto_is_int4_on_cpus_with_the_native_product_and_never_on_gpus():
    auto = QuantizationConfig(method="auto")
    cpu = torch.device("cpu")
    native = load() != "torch"
    assert resolve_quantization(auto, cpu).method == ("int4" if native else "none")
    assert resolve_quantization(auto, cpu).group_size == (32 if native else None)
    assert resolve_quantization(auto, torch.device("cuda")).method == "none"
    explicit = QuantizationConfig(method="int8")
    assert resolve_quantization(explicit, cpu) == explicit


def test_the_server_quantizes_automatically_unless_told_otherwise():
    assert ServerConfig().engine.quantization.method == "auto"
    assert load_config(environ={}).engine.quantization.method == "auto"
    assert ServerConfig(engine={"dtype": "float32"}).engine.quantization.method == "auto"
    assert ServerConfig(engine={"quantization": "none"}).engine.quantization.method == "none"
    assert ServerConfig(engine={"quant": {"enabled": False}}).engine.quantization.method == "none"
    assert EngineConfig().quantization.method == "none"  # the library: what it is given


def test_the_flag_and_the_environment_set_it():
    from server.cli import build_parser

    flags = flags_from_args(build_parser().parse_args(["serve", "--quantization", "int8"]))
    assert load_config(flags, environ={}).engine.quantization.method == "int8"
    config = load_config(environ={"SPLITFUSE_QUANTIZATION": "int4"})
    assert config.engine.quantization.method == "int4"
