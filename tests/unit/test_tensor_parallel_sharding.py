"""Tensor-parallel plans without processes: which heads each rank holds, which models are refused,
and the per-step message packing (every input survives the trip)."""

from __future__ import annotations

import pytest
import torch

from engine.input_builder import build_model_input
from engine.model_config import ModelConfig
from engine.tensor_parallel.protocol import HEADER_SIZE, pack_model_input, unpack_model_input
from engine.tensor_parallel.sharding import (
    HeadShard,
    TensorParallelConfigError,
    check_tensor_parallel,
    shard_heads,
)
from scheduler.batch import BatchRow, ScheduledBatch


def _config(num_heads: int, num_kv_heads: int, intermediate_size: int = 128) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 1000,
            "hidden_size": 64 * num_heads,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": 2,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
        }
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "world_size", "expected"),
    [
        # even split of the KV heads
        (4, 2, 2, [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 1, 1)]),
        # SmolLM2: 9 query / 3 KV heads on 2 ranks -> whole groups, 1 and 2 KV heads
        (9, 3, 2, [HeadShard(0, 3, 0, 1), HeadShard(3, 6, 1, 2)]),
        # fewer KV heads than ranks: each KV head replicated, its query heads split
        (4, 1, 2, [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1)]),
        (8, 2, 4, [HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1), HeadShard(4, 2, 1, 1),
                   HeadShard(6, 2, 1, 1)]),
        (6, 6, 1, [HeadShard(0, 6, 0, 6)]),
    ],
)  # fmt: skip
def test_shard_heads_covers_every_head_once(num_heads, num_kv_heads, world_size, expected) -> None:
    shards = [shard_heads(num_heads, num_kv_heads, rank, world_size) for rank in range(world_size)]
    assert shards == expected
    group_size = num_heads // num_kv_heads
    query_heads = [h for s in shards for h in range(s.head_start, s.head_start + s.num_heads)]
    assert query_heads == list(range(num_heads))
    for shard in shards:
        # local query head i uses local KV head i // local group size, as the attention op does
        local_group = shard.num_heads // shard.num_kv_heads
        for i in range(shard.num_heads):
            global_kv = (shard.head_start + i) // group_size
            assert global_kv == shard.kv_head_start + i // local_group


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "world_size", "fragment"),
    [
        (6, 3, 4, "multiple of the KV heads"),  # 3 KV heads cannot be replicated onto 4 ranks
        (6, 2, 4, "divide the query heads"),  # 6 query heads do not split over 4 ranks
    ],
)
def test_unsplittable_heads_are_refused(num_heads, num_kv_heads, world_size, fragment) -> None:
    with pytest.raises(TensorParallelConfigError, match=fragment):
        check_tensor_parallel(_config(num_heads, num_kv_heads), world_size)


def test_uneven_mlp_is_refused_and_good_configs_pass() -> None:
    with pytest.raises(TensorParallelConfigError, match="intermediate_size"):
        check_tensor_parallel(_config(4, 2, intermediate_size=130), 4)
    with pytest.raises(TensorParallelConfigError, match=">= 1"):
        check_tensor_parallel(_config(4, 2), 0)
    check_tensor_parallel(_config(9, 3, intermediate_size=1536), 2)  # the default model
    check_tensor_parallel(_config(9, 3, intermediate_size=1536), 3)
    check_tensor_parallel(_config(4, 2), 1)


def test_pack_and_unpack_round_trip_every_input() -> None:
    rows = (
        BatchRow("a", (50,), 5, (3, 8), True),
        BatchRow("b", (60, 61, 62), 2, (6, 1), False),
        BatchRow("c", (70, 71), 0, (2,), True),
    )
    inputs = build_model_input(ScheduledBatch(rows=rows), block_size=4)
    header, payload = pack_model_input(inputs)
    assert header.shape == (HEADER_SIZE,) and header.dtype == torch.int64
    assert payload.numel() == 3 * 6 + 4 + 3 + 3 * 2 + 2
    # the receiver's payload size formula (engine/tensor_parallel/protocol.receive_step)
    h = header.tolist()
    assert payload.numel() == h[1] * 3 + h[2] * (2 + h[3]) + 1 + h[4]
    got = unpack_model_input(header, payload)
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(got, name), getattr(inputs, name)), name
        assert getattr(got, name).dtype == getattr(inputs, name).dtype
    for name in ("slot_mapping", "query_start", "context_lens", "block_tables"):
        want, have = getattr(inputs.metadata, name), getattr(got.metadata, name)
        assert torch.equal(have, want) and have.dtype == want.dtype, name
    assert got.metadata.max_query_len == 3 and got.metadata.max_context_len == 6


def test_the_first_prompt_token_travels_with_the_step() -> None:
    rows = (
        BatchRow("a", (50,), 5, (3, 8), True, 5),
        BatchRow("b", (60, 61, 62), 2, (6, 1), False, 9),
    )
    for prompt_tiles, tile_from in ((False, None), (True, 1)):
        inputs = build_model_input(ScheduledBatch(rows=rows), 4, prompt_tiles=prompt_tiles)
        assert inputs.tile_from == tile_from
        assert unpack_model_input(*pack_model_input(inputs)).tile_from == tile_from


def test_unpack_refuses_a_short_payload() -> None:
    rows = (BatchRow("a", (1, 2, 3), 0, (0,), True),)
    header, payload = pack_model_input(build_model_input(ScheduledBatch(rows=rows), 4))
    with pytest.raises(RuntimeError, match="expected"):
        unpack_model_input(header, payload[:-1])
