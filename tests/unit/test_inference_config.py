"""``init_inference``'s configuration: DeepSpeed's names and aliases, what is refused, and the
``EngineConfig`` it becomes."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.inference import InferenceConfig, init_inference


def test_defaults_follow_the_model() -> None:
    config = InferenceConfig()
    assert config.replace_with_kernel_inject and not config.moe.enabled
    engine = config.engine_config("float32")
    assert engine.dtype == "float32" and engine.tensor_parallel_size == 1
    assert not engine.compile and engine.quantization.method == "none"
    assert engine.max_model_len is None


@pytest.mark.parametrize(
    "given",
    [
        {"tensor_parallel": {"tp_size": 2}},
        {"tp": {"tp_size": 2}},
        {"tp_size": 2},
        {"mp_size": 2},
        {"mp_size": 2, "tensor_parallel": {"tp_size": 2}},
    ],
)
def test_tensor_parallel_spellings(given: dict) -> None:
    assert InferenceConfig(**given).engine_config("float32").tensor_parallel_size == 2


def test_conflicting_tensor_parallel_sizes_are_refused() -> None:
    with pytest.raises(ValidationError, match="mp_size 2 conflicts with tensor_parallel.tp_size"):
        InferenceConfig(mp_size=2, tensor_parallel={"tp_size": 4})
    with pytest.raises(ValidationError, match="conflicting tensor-parallel sizes"):
        InferenceConfig(mp_size=2, tp_size=4)
    with pytest.raises(ValidationError, match="tp_size 2 with enabled false"):
        InferenceConfig(tensor_parallel={"enabled": False, "tp_size": 2})


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (torch.float16, "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        (torch.bfloat16, "bfloat16"),
        ("bf16", "bfloat16"),
        ("torch.float32", "float32"),
        ("fp32", "float32"),
    ],
)
def test_dtype_spellings(value: object, name: str) -> None:
    assert InferenceConfig(dtype=value).engine_config("float32").dtype == name


def test_int8_dtype_points_to_quant() -> None:
    with pytest.raises(ValidationError, match="quant="):
        InferenceConfig(dtype=torch.int8)
    with pytest.raises(ValidationError, match="unsupported dtype"):
        InferenceConfig(dtype="float64")


def test_field_mapping_onto_the_engine() -> None:
    config = InferenceConfig(
        kernel_inject=True,
        enable_cuda_graph=True,
        quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 64}},
        max_tokens=256,
        engine={"num_kv_blocks": 32, "block_size": 4, "max_batch_tokens": 64},
    )
    engine = config.engine_config("bfloat16")
    assert engine.compile and engine.dtype == "bfloat16"
    assert (engine.quantization.method, engine.quantization.group_size) == ("int4", 64)
    assert engine.max_model_len == 256
    assert (engine.num_kv_blocks, engine.block_size, engine.max_batch_tokens) == (32, 4, 64)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"injection_policy": {"LlamaDecoderLayer": ("o_proj",)}}, "injection_policy is not"),
        ({"checkpoint": "ckpt.json"}, "checkpoint is not supported"),
        ({"zero": {"stage": 3}}, "zero is not supported"),
        ({"tensor_parallel": {"tp_size": 2, "tp_group": object()}}, "tensor_parallel.tp_group"),
        ({"moe": {"ep_group": object()}}, "moe.ep_group is not supported"),
        ({"replace_with_kernel_inject": False}, "always runs on this engine's layers"),
        ({"kernel_inject": False}, "always runs on this engine's layers"),
        ({"moe": {"ep_size": 2}}, "expert parallelism is not supported"),
        ({"moe": {"type": "residual"}}, "standard"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"engine": {"no_such_field": 1}}, "no_such_field"),
        ({"engine": {"dtype": "float32"}}, "set it by dtype"),
        ({"engine": {"tp": 2}}, "set it by tensor_parallel.tp_size"),
        ({"engine": {"block_size": 0}}, "block_size"),
        ({"quant": {"enabled": True, "weight": {"num_bits": 3}}}, "num_bits must be 4 or 8"),
        ({"max_out_tokens": 1}, "max_out_tokens"),
        (
            {"enable_cuda_graph": True, "tensor_parallel": {"tp_size": 2}},
            "enable_cuda_graph with tensor_parallel.tp_size > 1",
        ),
    ],
)
def test_refused_with_the_field_named(given: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        InferenceConfig(**given)


def test_moe_forms() -> None:
    assert InferenceConfig(moe=True).moe.enabled
    assert not InferenceConfig(moe=False).moe.enabled
    config = InferenceConfig(moe_experts=[8], ep_size=1, moe_type="standard")
    assert config.moe.enabled and config.moe.moe_experts == [8]
    assert not InferenceConfig(moe=False, moe_experts=[8]).moe.enabled


def test_config_is_frozen() -> None:
    config = InferenceConfig()
    with pytest.raises(ValidationError):
        config.enable_cuda_graph = True


def test_config_and_keyword_arguments_must_agree(tmp_path) -> None:  # noqa: ANN001
    # refused before the model is looked at
    with pytest.raises(ValueError, match="conflicting 'dtype'"):
        init_inference(object(), {"dtype": "float16"}, dtype="float32")
    with pytest.raises(TypeError, match="expected a transformers model"):
        init_inference(object(), InferenceConfig(dtype="float32"), dtype="float32")
    with pytest.raises(TypeError, match="config must be an InferenceConfig, a dict or a JSON"):
        init_inference(object(), 16)
    path = tmp_path / "ds_config.json"  # DeepSpeed's config file
    path.write_text('{"dtype": "fp16", "tensor_parallel": {"tp_size": 1}}')
    with pytest.raises(ValueError, match="conflicting 'dtype'"):
        init_inference(object(), str(path), dtype="float32")
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        init_inference(object(), path)
