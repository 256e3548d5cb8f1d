"""The decode stack (``engine/decode_stack.py``, ``kernels/cpu/decode_stack.cpp``): a Llama's
decode steps in one C++ call (4-bit weights, or bfloat16 ones in the blocked layout), against
the same steps through the model's forward.

With 4-bit weights both run the same products and attention kernels, and the forward's norms,
rotary and SiLU on a CPU are the stack's own (the operators ``rms_norm_rows``, ``rotary_rows``
and ``silu_mul_rows``): the logits and the stored K/V are the same bits. With bfloat16 weights the
forward's products are oneDNN's where the stack runs ``blocked_linear``: their sums part in a
float32's last bit, which a bfloat16 rounding can turn into one bfloat16 step (2^-8 relative) of
a value now and then, so the stored K/V agree to a bfloat16 step or two and the logits to 3%
relative RMS (a wrong head, position or layout gives 30% and more). Greedy tokens agree (the
tiny models' logits spread, std ~1).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.decode_stack import MAX_TOKENS, unsupported
from engine.device import KV_CACHE_DTYPES
from engine.input_builder import build_decode_steps, build_model_input
from engine.llm_engine import LLMEngine
from kernels.cpu_ops import has_blocked_linear, has_fixed_order_attention
from scheduler.batch import BatchRow, ScheduledBatch
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not has_fixed_order_attention(), reason="the C++ operators are not built"
)

BLOCK_SIZE = 4


def int4_engine(model_dir, dtype: str, **overrides) -> LLMEngine:
    config = dict(
        model=str(model_dir),
        dtype=dtype,
        num_kv_blocks=512,
        block_size=BLOCK_SIZE,
        quantization={"method": "int4", "group_size": 32},
    )
    config.update(overrides)
    return LLMEngine(EngineConfig(**config))


def run(engine: LLMEngine, rows: list[BatchRow]) -> torch.Tensor:
    inputs = build_model_input(ScheduledBatch(rows=tuple(rows)), block_size=BLOCK_SIZE)
    return engine.runner.run(inputs)


def prefilled(engine: LLMEngine, num_rows: int, seed: int = 0) -> list[BatchRow]:
    """Prompts of 5 .. 27 tokens written into the cache (one prompt step), and the decode rows
    that follow them: one token each, at the position after its prompt."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts, decodes, next_block = [], [], 0
    for r in range(num_rows):
        length = rng.randrange(5, 28)
        table = tuple(range(next_block, next_block + length // BLOCK_SIZE + 1))
        next_block += len(table)
        ids = tuple(rng.randrange(vocab) for _ in range(length))
        prompts.append(BatchRow(f"r{r}", ids, 0, table, True))
        decodes.append(BatchRow(f"r{r}", (rng.randrange(vocab),), length, table, True))
    run(engine, prompts)
    return decodes


INT4 = {"method": "int4", "group_size": 32}
WEIGHTS = {  # (dtype, quantization, the KV cache's dtype)
    "int4 float32": ("float32", INT4, "float32"),
    "int4 float32, bfloat16 cache": ("float32", INT4, "bfloat16"),
    # (auto's cache for float32 activations and quantized weights)
    "int4 float32, float16 cache": ("float32", INT4, "float16"),
    "int4 bfloat16": ("bfloat16", INT4, "bfloat16"),
    "int4 bfloat16, fp8 cache": ("bfloat16", INT4, "fp8"),
    "bfloat16 blocked": ("bfloat16", "none", "bfloat16"),
}


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("num_rows", [1, 3, 8, MAX_TOKENS])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_steps_match_the_model_forward(tiny_llama_dir, weights, num_rows, threads):
    dtype, quantization, cache_dtype = WEIGHTS[weights]
    if quantization == "none" and not has_blocked_linear():
        pytest.skip("blocked_linear needs AVX-512 BF16")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = int4_engine(
            tiny_llama_dir, dtype, quantization=quantization, kv_cache_dtype=cache_dtype
        )
        assert engine.runner.kv_cache.dtype == KV_CACHE_DTYPES[cache_dtype]
        runner = engine.runner
        stack = runner.decode_stack
        if stack is None and quantization == "none":
            why = unsupported(runner.model, runner.parallel, False, runner.kv_cache)
            assert "blocked layout" in why
            pytest.skip("oneDNN packed a weight in another layout at this thread count")
        assert stack is not None
        decodes = prefilled(engine, num_rows)
        before = runner.kv_cache.clone()
        got = run(engine, decodes)
        got_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        runner.decode_stack = None
        want = run(engine, decodes)
        want_cache = runner.kv_cache
    finally:
        torch.set_num_threads(previous)
    assert not torch.equal(got_cache, before), "the stack stored no K/V"
    if quantization != "none":  # the same kernels and the same arithmetic
        assert torch.equal(got_cache, want_cache)
        assert torch.equal(got, want)
        return
    step = (want_cache.float().abs() * 2**-7).clamp_min(1e-30)  # two bfloat16 steps
    assert ((got_cache.float() - want_cache.float()).abs() <= step).all()
    rms = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
    assert rms < 0.03, f"relative RMS {rms:.3f}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("num_rows", [1, 3, MAX_TOKENS])
def test_a_step_gives_the_same_bits_whichever_thread_takes_which_work(tiny_llama_dir, num_rows):
    """The threads share out each product's column blocks and attention's items as they go
    (a thread done with its own share takes the rest of another's): the same step run again,
    by more threads than cores so that they run unevenly, gives the same logits and cache."""
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        engine = int4_engine(tiny_llama_dir, "bfloat16")
        runner = engine.runner
        assert runner.decode_stack is not None
        decodes = prefilled(engine, num_rows)
        before = runner.kv_cache.clone()
        first = run(engine, decodes)
        first_cache = runner.kv_cache.clone()
        for _ in range(8):
            runner.kv_cache.copy_(before)
            assert torch.equal(run(engine, decodes), first)
            assert torch.equal(runner.kv_cache, first_cache)
    finally:
        torch.set_num_threads(previous)


def test_greedy_generation_is_the_same_with_and_without_the_stack(tiny_llama_dir):
    prompts = [[5, 17, 99, 3], [42] * 9, list(range(100, 121))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for use in (True, False):
        engine = int4_engine(tiny_llama_dir, "float32", num_scheduler_steps=1)
        if not use:
            engine.runner.decode_stack = None
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        outputs[use] = tokens
    assert outputs[True] == outputs[False]


def generate(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[dict[str, list[int]], dict[str, str], list[int]]:
    """Each request's tokens and finish reason, and the steps of each batch."""
    passes: list[int] = []
    schedule = engine.scheduler.schedule

    def recorded() -> ScheduledBatch:
        batch = schedule()
        passes.append(batch.num_steps)
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params[i])
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
    engine.scheduler.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.num_kv_blocks  # lookahead blocks freed
    return tokens, reasons, passes


def test_several_decode_steps_per_pass_give_the_tokens_of_one_step_at_a_time(tiny_llama_dir):
    """Batches of several decode steps (``num_scheduler_steps``; the default with the stack)
    sample the tokens one step at a time would, and end requests on the same token: at
    max_tokens, on a stop token in the middle of a pass, after min_tokens; a random request
    keeps its batches to one step while it runs."""
    prompts = [[5, 17, 99, 3], [42] * 9, list(range(100, 121)), [8, 9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first, _, _ = generate(int4_engine(tiny_llama_dir, "float32", num_scheduler_steps=1),
                           prompts, [greedy] * 4)  # fmt: skip
    stop = first["p1"][9]  # (its first occurrence ends p1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop,), min_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True),
    ]
    one = generate(int4_engine(tiny_llama_dir, "float32", num_scheduler_steps=1), prompts, params)
    assert set(one[2]) == {1}
    assert one[0]["p1"][-1] == stop and one[1]["p1"] == "stop"
    for num_steps in (3, None):
        engine = int4_engine(tiny_llama_dir, "float32", num_scheduler_steps=num_steps)
        assert engine.num_scheduler_steps == (num_steps or 4)
        tokens, reasons, passes = generate(engine, prompts, params)
        assert (tokens, reasons) == one[:2]
        assert max(passes) == engine.num_scheduler_steps and len(passes) < len(one[2])


def test_greedy_steps_are_logits_calls_in_turn_and_check_every_step_first(tiny_llama_dir):
    engine = int4_engine(tiny_llama_dir, "float32")
    call = engine.runner.decode_stack.call
    rows = [  # two more blocks each, past the ones the prompts took
        dataclasses.replace(row, block_table=row.block_table + (400 + 2 * i, 401 + 2 * i))
        for i, row in enumerate(prefilled(engine, 3))
    ]
    steps = build_decode_steps(ScheduledBatch(rows=tuple(rows), num_steps=3), BLOCK_SIZE)
    cache = engine.runner.kv_cache
    before = cache.clone()

    def greedy_steps(slots=steps.slot_mapping, context_lens=steps.context_lens):
        return call.greedy_steps(steps.input_ids, steps.positions, cache, slots,
                                 steps.block_tables, steps.query_start, context_lens)  # fmt: skip

    got = greedy_steps()
    after = cache.clone()
    cache.copy_(before)
    ids, want = steps.input_ids, []
    for k in range(3):
        step = (steps.positions[k], cache, steps.slot_mapping[k], steps.block_tables)
        _, ids = call.logits(ids, *step, steps.query_start, steps.context_lens[k])
        want.append(ids)
    assert torch.equal(got, torch.stack(want)) and torch.equal(cache, after)
    cache.copy_(before)
    bad_slots = steps.slot_mapping.clone()
    bad_slots[2, 1] = 10**6  # the last step's: refused before the first runs
    for bad in (dict(slots=bad_slots), dict(context_lens=steps.context_lens[:2])):
        with pytest.raises(RuntimeError, match="DecodeStack"):
            greedy_steps(**bad)
        assert torch.equal(cache, before)


def test_several_decode_steps_need_the_stack_with_the_lm_head(tiny_llama_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps 4 needs the CPU decode stack"):
        LLMEngine(
            EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                         num_scheduler_steps=4)
        )  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    assert engine.num_scheduler_steps == 1 and engine.scheduler.max_decode_steps == 1


BAD_INPUTS = {
    "too many tokens": dict(tokens=MAX_TOKENS + 1),
    "hidden in another dtype": dict(hidden_dtype=torch.float64),
    "hidden of another width": dict(hidden_width=32),
    "a position past the rotary table": dict(position=10**6),
    "a negative position": dict(position=-1),
    "a slot past the cache": dict(slot=64 * BLOCK_SIZE),
    "a slot below -1": dict(slot=-2),
    "an empty context": dict(context_len=0),
    "a context past the table": dict(context_len=3 * BLOCK_SIZE),
    "a block past the cache": dict(block=64),
    "a negative block": dict(block=-1),
    "int64 tables": dict(tables_dtype=torch.int64),
    "a float64 cache": dict(cache_dtype=torch.float64),
    "a cache of other layers": dict(cache_layers=3),
    "int32 positions": dict(positions_dtype=torch.int32),
    "a row of two tokens": dict(query_start=[0, 2]),
    "a position before its context's last": dict(position=4),
    "a slot not its position's": dict(slot=6),
}


def step_inputs(engine: LLMEngine, **bad) -> tuple:
    """A one-token step (position 5, context 6, slot 5 in block 1), with ``bad``'s changes."""
    tokens = bad.get("tokens", 1)
    hidden = torch.randn(tokens, bad.get("hidden_width", 64), dtype=bad.get("hidden_dtype"))
    positions = torch.full((tokens,), bad.get("position", 5), dtype=bad.get("positions_dtype"))
    slots = torch.full((tokens,), bad.get("slot", 5), dtype=torch.int64)
    tables = torch.tensor([[0, bad.get("block", 1)]] * tokens)
    tables = tables.to(bad.get("tables_dtype", torch.int32))
    query_start = torch.tensor(bad.get("query_start", range(tokens + 1)), dtype=torch.int32)
    context_lens = torch.full((tokens,), bad.get("context_len", 6), dtype=torch.int32)
    cache = engine.runner.kv_cache
    if "cache_dtype" in bad:
        cache = cache.to(bad["cache_dtype"])
    if "cache_layers" in bad:
        cache = torch.zeros((bad["cache_layers"], *cache.shape[1:]), dtype=cache.dtype)
    return hidden, positions, cache, slots, tables, query_start, context_lens


def test_the_refusals_start_from_a_step_that_runs(tiny_llama_dir):
    engine = int4_engine(tiny_llama_dir, "float32")
    out = engine.runner.decode_stack.call.run(*step_inputs(engine))
    assert out.shape == (1, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused_and_change_nothing(tiny_llama_dir, case):
    engine = int4_engine(tiny_llama_dir, "float32")
    args = step_inputs(engine, **BAD_INPUTS[case])
    cache = args[2]
    before = cache.clone()
    with pytest.raises(RuntimeError, match="DecodeStack"):
        engine.runner.decode_stack.call.run(*args)
    assert torch.equal(cache, before)


BAD_IDS = {
    "an id past the vocabulary": torch.tensor([10**6]),
    "a negative id": torch.tensor([-1]),
    "int32 ids": torch.tensor([3], dtype=torch.int32),
    "ids of two dims": torch.tensor([[3]]),
    "too many ids": torch.tensor([3] * (MAX_TOKENS + 1)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_from_token_ids_gives_the_model_logits(tiny_llama_dir, dtype):
    """The 8-bit embedding and LM head in the call: the logits of the step's sampled rows (in
    bfloat16 too the head's float32 sums, not rounded, as the model's quantized head returns
    them), the bad inputs of run refused there too, bad ids refused before the cache is
    touched."""
    engine = int4_engine(tiny_llama_dir, dtype)
    stack = engine.runner.decode_stack
    assert stack.holds_head
    _, positions, cache, slots, tables, query_start, context_lens = step_inputs(engine)
    ids = torch.tensor([7])
    logits, greedy = stack.call.logits(
        ids, positions, cache, slots, tables, query_start, context_lens
    )
    assert logits.shape == (1, engine.model_config.vocab_size) and logits.dtype == torch.float32
    assert torch.equal(greedy, logits.argmax(dim=-1))
    hidden = stack.model.model.embed_tokens(ids)
    cache.zero_()
    again = stack.call.run(hidden, positions, cache, slots, tables, query_start, context_lens)
    torch.testing.assert_close(logits, stack.model.compute_logits(again, torch.tensor([0])))
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bfloat16
    for case, bad_ids in BAD_IDS.items():
        before = cache.clone()
        with pytest.raises(RuntimeError, match="DecodeStack"):
            count = bad_ids.reshape(-1).shape[0]
            stack.call.logits(
                bad_ids,
                positions.repeat(count),
                cache,
                slots.repeat(count),
                tables.repeat(count, 1),
                torch.arange(count + 1, dtype=torch.int32),
                context_lens.repeat(count),
            )
        assert torch.equal(cache, before), case
    bad = step_inputs(engine, slot=-2)
    with pytest.raises(RuntimeError, match="DecodeStack"):
        stack.call.logits(ids, *bad[1:])


def test_the_argmax_joins_the_units_columns_as_torch_argmax(tiny_llama_dir):
    """The threads compute the LM head's columns in units of 512 and take each unit's argmax;
    joined in column order they give torch.argmax's index: the first of equal maxima, a NaN the
    largest (the first). (The tiny model's 1,000 columns: two units.)"""
    engine = int4_engine(tiny_llama_dir, "float32")
    stack = engine.runner.decode_stack
    scales = stack.model.lm_head.qscales  # [blocks, groups, 16] float16, the call's own
    _, positions, cache, slots, tables, query_start, context_lens = step_inputs(engine)
    vocab = engine.model_config.vocab_size
    late = vocab - 5  # a column of the last unit

    def greedy() -> int:
        ids = torch.tensor([7])
        logits, greedy = stack.call.logits(
            ids, positions, cache, slots, tables, query_start, context_lens
        )
        assert torch.equal(greedy, logits.argmax(dim=-1))
        return int(greedy)

    greedy()  # the model's own logits
    scales.zero_()  # every logit 0: equal maxima in every unit's columns, the first wins
    assert greedy() == 0
    scales[late // 16, :, late % 16] = float("nan")  # a NaN in the last unit's columns
    assert greedy() == late
    scales[3 // 16, :, 3 % 16] = float("nan")  # and one in the first's
    assert greedy() == 3


def test_only_the_sampled_rows_logits(tiny_llama_dir):
    engine = int4_engine(tiny_llama_dir, "float32")
    runner = engine.runner
    decodes = prefilled(engine, 3)
    before = runner.kv_cache.clone()
    every = run(engine, decodes)
    runner.kv_cache.copy_(before)
    inputs = build_model_input(ScheduledBatch(rows=tuple(decodes)), block_size=BLOCK_SIZE)
    some, greedy = runner.decode_stack(
        inputs.input_ids,
        inputs.positions,
        inputs.metadata,
        runner.kv_cache,
        torch.tensor([2, 0]),
    )
    assert torch.equal(some, every[[2, 0]])
    assert torch.equal(greedy, every[[2, 0]].argmax(dim=-1))


def test_the_forward_runs_the_stacks_norms_rotary_and_silu_with_4bit_weights_only(
    tiny_llama_dir,
):
    """With 4-bit weights the forward's norms, rotary and SiLU are the stack's (the same bits
    for a decode token either way); with other weights, whose products are not the stack's,
    they stay PyTorch's."""
    assert int4_engine(tiny_llama_dir, "float32").runner.backend.row_ops
    plain = int4_engine(tiny_llama_dir, "float32", quantization="none")
    assert not plain.runner.backend.row_ops


def test_where_the_stack_applies(tiny_llama_dir, tiny_qwen2_dir):
    assert int4_engine(tiny_llama_dir, "bfloat16").runner.decode_stack.holds_head
    runner = int4_engine(tiny_llama_dir, "bfloat16", quantization="none").runner
    bfloat16 = runner.decode_stack
    if not has_blocked_linear():
        assert bfloat16 is None
    elif bfloat16 is None:  # oneDNN packed a weight in a layout of its own (AMX)
        why = unsupported(runner.model, runner.parallel, False, runner.kv_cache)
        assert "blocked layout" in why
    assert bfloat16 is None or not bfloat16.holds_head  # a bfloat16 embedding and LM head
    assert int4_engine(tiny_llama_dir, "float32", quantization="none").runner.decode_stack is None
    assert int4_engine(tiny_llama_dir, "float32", quantization="int8").runner.decode_stack is None
    assert int4_engine(tiny_qwen2_dir, "float32").runner.decode_stack is None  # q/k/v biases
    runner = int4_engine(tiny_llama_dir, "float32").runner
    assert "deterministic" in unsupported(runner.model, runner.parallel, True, runner.kv_cache)
    assert "bias" in unsupported(
        int4_engine(tiny_qwen2_dir, "float32").runner.model,
        runner.parallel,
        False,
        runner.kv_cache,
    )


def test_prompt_steps_and_larger_steps_go_to_the_model(tiny_llama_dir):
    engine = int4_engine(tiny_llama_dir, "float32")
    calls = []
    stack_call = engine.runner.decode_stack.call

    class Counting:
        def run(self, *args):
            calls.append(args[0].shape[0])
            return stack_call.run(*args)

        def logits(self, *args):
            calls.append(args[0].shape[0])
            return stack_call.logits(*args)

    engine.runner.decode_stack.call = Counting()
    decodes = prefilled(engine, MAX_TOKENS + 1)  # a prompt step: not the stack's
    assert calls == []
    run(engine, decodes)  # too many tokens
    assert calls == []
    run(engine, decodes[:2])
    assert calls == [2]
