"""Structured outputs in the engine: grammar compilation and its errors, the batched bitmask, the
sampler's masked rows beside untouched ones, dead ends, and preemption keeping the grammar state."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler
from engine.structured_output import GrammarError, GrammarTokenizer, apply_bitmask
from scheduler.batch import NewRequestData
from scheduler.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def grammar_tokenizer(tiny_llama_dir) -> GrammarTokenizer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return GrammarTokenizer(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def test_llguidance_tokenizer_is_built_once_on_first_use(tiny_llama_dir) -> None:
    """A server without structured outputs never builds llguidance's token tables; the first
    grammar builds them once, however many threads ask at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    lazy = GrammarTokenizer(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    assert lazy._llg is None
    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: lazy.llg, range(8)))
    assert all(llg is built[0] for llg in built)
    lazy.check(JSON)
    assert lazy.llg is built[0]


@pytest.mark.parametrize(
    ("structured", "words"),
    [
        (StructuredOutput("json_schema", '{"not": {"type": "string"}}'), "not"),
        (StructuredOutput("json_schema", '{"type": "objectx"}'), "objectx"),
        (StructuredOutput("json_schema", "{not json"), "JSON schema"),
        (StructuredOutput("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "5"),
        (StructuredOutput("regex", "(a"), "unclosed group"),
        (StructuredOutput("choice", "[]"), "non-empty"),
        (StructuredOutput("choice", '["a", 1]'), "strings"),
        (StructuredOutput("grammar", "start: foo"), "foo"),
    ],
)
def test_unsupported_grammars_name_the_part(grammar_tokenizer, structured, words) -> None:
    with pytest.raises(GrammarError, match=re.escape(words)):
        grammar_tokenizer.check(structured)


def test_structured_output_refuses_what_would_hide_its_end() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=JSON)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=JSON)
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "<a/>")


def test_apply_bitmask_matches_the_bits() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab_size = 70  # not a multiple of 32: the last word is cut
    logits = torch.randn(3, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    masked = logits.clone()
    apply_bitmask(masked, torch.tensor([0, 2]), bitmask)
    for row, mask_row in ((0, 0), (2, 1)):
        for token in range(vocab_size):
            allowed = (int(bitmask[mask_row, token // 32]) >> (token % 32)) & 1
            expected = logits[row, token] if allowed else float("-inf")
            assert masked[row, token] == expected
    assert torch.equal(masked[1], logits[1])


def _new(request_id: str, params: SamplingParams) -> NewRequestData:
    return NewRequestData(request_id, (5, 6, 7), params, eos_token_ids=(2,))


def test_sampler_masks_structured_rows_only(grammar_tokenizer) -> None:
    vocab_size = grammar_tokenizer.vocab_size
    sampler = Sampler(vocab_size, torch.device("cpu"), seed=0)
    sampler.enable_structured_output(grammar_tokenizer)
    plain = Sampler(vocab_size, torch.device("cpu"), seed=0)
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    sampler.add_request(_new("free", SamplingParams(temperature=0.0)))
    sampler.add_request(_new("json", SamplingParams(temperature=1.0, seed=3, structured=JSON)))
    sampler.add_request(_new("choice", SamplingParams(temperature=0.0, structured=choice)))
    plain.add_request(_new("free", SamplingParams(temperature=0.0)))
    generator = torch.Generator().manual_seed(1)
    outputs = {"json": [], "choice": []}
    for _ in range(40):
        logits = torch.randn(3, vocab_size, generator=generator)
        ids = ["free", "json", "choice"]
        sampler.start_masks(ids)
        out = sampler.sample(logits, ids)
        assert out.dead_ends == {}
        assert out.token_ids[0] == plain.sample(logits[:1], ["free"]).token_ids[0]
        for name, token in zip(ids[1:], out.token_ids[1:], strict=True):
            if not outputs[name] or outputs[name][-1] != 2:
                outputs[name].append(token)
    tokenizer = grammar_tokenizer
    for name, tokens in outputs.items():
        assert tokens[-1] == 2, f"{name} did not end"
    json_text = tokenizer.llg.decode_str(outputs["json"][:-1])
    document = json.loads(json_text)
    assert set(document) == {"name", "n", "tags"} and 0 <= document["n"] <= 99
    assert tokenizer.llg.decode_str(outputs["choice"][:-1]) in ("yes", "no")
    sampler.remove_requests(["json", "choice"])
    assert len(sampler.matchers) == 0


def test_a_dead_end_is_reported_not_sampled(grammar_tokenizer) -> None:
    sampler = Sampler(grammar_tokenizer.vocab_size, torch.device("cpu"), seed=0)
    sampler.enable_structured_output(grammar_tokenizer)
    regex = StructuredOutput("regex", "ab")
    sampler.add_request(_new("r", SamplingParams(temperature=0.0, structured=regex)))
    sampler.add_request(_new("free", SamplingParams(temperature=0.0)))
    # a token outside the grammar (as a bug or a corrupted state would feed it) puts the matcher
    # into its error state: the next step reports the dead end instead of sampling on
    bad_token = grammar_tokenizer.llg.tokenize_str("zz")[0]
    assert sampler.matchers.accept("r", bad_token) is not None
    logits = torch.zeros(2, grammar_tokenizer.vocab_size)
    out = sampler.sample(logits, ["r", "free"])
    assert list(out.dead_ends) == [0]
    assert "dead end" in out.dead_ends[0]


def test_sampler_without_structured_outputs_refuses_them() -> None:
    sampler = Sampler(100, torch.device("cpu"))
    with pytest.raises(Exception, match="not enabled"):
        sampler.add_request(_new("a", SamplingParams(structured=JSON)))


def _run(engine: LLMEngine, params: list[SamplingParams]) -> tuple[list[list[int]], int]:
    for index, request_params in enumerate(params):
        engine.add_request(f"r{index}", [5 + index, 6, 7, 8, 9, 10, 11, 12], request_params)
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
    assert set(reasons.values()) <= {"stop", "length"}
    return [tokens[f"r{i}"] for i in range(len(params))], engine.stats().num_preemptions


def test_preemption_keeps_the_grammar_state(tiny_llama_dir) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured=JSON),
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured=JSON),
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=1.0, seed=9, max_tokens=40, structured=JSON),
    ]
    roomy = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64))
    expected, num_preemptions = _run(roomy, params)
    assert num_preemptions == 0
    # 4 requests of up to 48 tokens in 10 blocks of 16: decodes preempt the newest requests
    tight = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=10, block_size=16)
    )
    got, num_preemptions = _run(tight, params)
    assert num_preemptions > 0
    assert got == expected
    tight.step()  # the runner drops finished requests' state at the next step
    assert len(tight.runner.sampler.matchers) == 0  # every matcher freed with its request
