"""LLMEngine: input validation, abort, stop and length, logprobs, stats, and a failing step that
fails the requests that cause it only."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, block_size=4)
    )


def _drain(engine: LLMEngine) -> dict[str, list]:
    """Steps until idle; request id -> its deltas."""
    deltas: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def test_idle_step_returns_nothing(engine) -> None:
    assert engine.step() == []
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "at least one token"),
        ([1, 2, 5000], GREEDY, "outside \\[0, 1000\\)"),
        ([1, -1], GREEDY, "outside"),
        (list(range(3, 10)) * 200, GREEDY, "max_model_len"),
        ([1, 2], SamplingParams(stop_token_ids=(1000,)), "stop_token_ids"),
        ([1, 2], SamplingParams(logit_bias={4000: 1.0}), "logit_bias"),
    ],
)
def test_bad_requests_raise_and_change_nothing(engine, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    engine.add_request("bad", [5, 6], GREEDY)  # the id was not taken
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("bad", [5, 6], GREEDY)


def test_deltas_count_tokens_and_end_with_length(engine) -> None:
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=6))
    deltas = _drain(engine)["a"]
    assert [len(d.new_token_ids) for d in deltas] == [1] * 6
    assert [d.num_output_tokens for d in deltas] == [1, 2, 3, 4, 5, 6]
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert all(d.num_prompt_tokens == 5 and d.error is None for d in deltas)
    assert engine.stats().kv_cache_usage == 0.0


def test_outputs_carry_the_time_spent_waiting(engine) -> None:
    engine.add_request("a", [5, 6, 7], GREEDY, arrival_time=time.monotonic() - 2.0)
    deltas = _drain(engine)["a"]
    # The request arrived two seconds before it was first scheduled, and that time never changes.
    assert all(2.0 <= d.queue_seconds < 60.0 for d in deltas)
    assert len({d.queue_seconds for d in deltas}) == 1


def test_eos_stops_unless_ignored(engine) -> None:
    eos = engine.eos_token_ids[0]
    forced = {eos: 100.0}
    engine.add_request("stop", [5, 6], SamplingParams(temperature=0.0, logit_bias=forced))
    engine.add_request(
        "ignore", [5, 6], SamplingParams(temperature=0.0, max_tokens=3, logit_bias=forced,
                                         ignore_eos=True)
    )  # fmt: skip
    deltas = _drain(engine)
    assert [d.new_token_ids for d in deltas["stop"]] == [[eos]]
    assert deltas["stop"][-1].finish_reason == "stop"
    assert deltas["stop"][-1].stop_token_id == eos
    assert [d.new_token_ids for d in deltas["ignore"]] == [[eos]] * 3
    assert deltas["ignore"][-1].finish_reason == "length"


def test_logprobs_are_returned_when_asked(engine) -> None:
    engine.add_request("lp", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, logprobs=3))
    engine.add_request("none", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2))
    deltas = _drain(engine)
    for delta in deltas["lp"]:
        (logprob,) = delta.new_logprobs
        assert logprob.token_id == delta.new_token_ids[0]
        assert len(logprob.top) == 3 and logprob.top[0][0] == logprob.token_id  # greedy
        assert logprob.logprob <= 0.0
    assert all(delta.new_logprobs is None for delta in deltas["none"])


def test_abort_frees_blocks_and_reports(engine) -> None:
    engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=50))
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    output = engine.abort_request("a")
    assert output is not None and output.finish_reason == "abort" and output.finished
    assert engine.abort_request("a") is None
    assert engine.abort_request("unknown") is None
    assert engine.stats().num_running == 1
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.stats().kv_cache_usage == 0.0
    engine.scheduler.check_integrity()


def _poison_forward(engine: LLMEngine, monkeypatch, poison: int) -> dict[str, int]:
    """Makes every forward pass holding the token ``poison`` raise; counts the passes."""
    model = engine.runner.model
    real_forward = model.forward
    calls = {"passes": 0}

    def forward(input_ids, *args, **kwargs):
        calls["passes"] += 1
        if bool((input_ids == poison).any()):
            raise RuntimeError("simulated kernel failure")
        return real_forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    return calls


def test_a_failing_step_fails_the_request_that_causes_it_only(engine, monkeypatch, caplog) -> None:
    neighbours = {f"n{i}": [7 + i, 8, 9] for i in range(5)}
    for request_id, prompt in neighbours.items():  # alone first, for their tokens
        engine.add_request("alone-" + request_id, prompt, GREEDY)
    expected = {
        rid.removeprefix("alone-"): [t for d in ds for t in d.new_token_ids]
        for rid, ds in _drain(engine).items()
    }

    calls = _poison_forward(engine, monkeypatch, poison=999)
    engine.add_request("bad", [5, 999, 6], GREEDY)
    for request_id, prompt in neighbours.items():  # all in the same first batch
        engine.add_request(request_id, prompt, GREEDY)
    with caplog.at_level("ERROR", logger="engine.llm_engine"):
        outputs = engine.step()
    finish = {o.request_id: o.finish_reason for o in outputs}
    assert finish["bad"] == "error" and set(finish) == {"bad", *neighbours}
    assert all(finish[rid] is None for rid in neighbours)
    bad = next(o for o in outputs if o.request_id == "bad")
    assert "error id" in bad.error and "simulated kernel failure" not in bad.error
    error_id = bad.error.rsplit("error id ", 1)[1].rstrip(")")
    assert error_id in caplog.text and "simulated kernel failure" in caplog.text
    assert calls["passes"] <= 1 + 2 * 6  # the batch, then halves down to the culprit
    # the neighbours go on, with the tokens they get alone
    deltas = _drain(engine)
    for request_id in neighbours:
        first = [o for o in outputs if o.request_id == request_id][0].new_token_ids
        rest = [t for d in deltas[request_id] for t in d.new_token_ids]
        assert first + rest == expected[request_id]
        assert deltas[request_id][-1].finish_reason == "length"
    assert engine.stats().kv_cache_usage == 0.0
    engine.scheduler.check_integrity()


def test_a_step_failing_for_every_request_fails_them_all(engine, monkeypatch) -> None:
    _poison_forward(engine, monkeypatch, poison=999)
    engine.add_request("bad", [5, 999, 6], GREEDY)
    engine.add_request("also_bad", [999, 8], GREEDY)
    outputs = engine.step()
    assert {o.request_id: o.finish_reason for o in outputs} == {
        "bad": "error",
        "also_bad": "error",
    }
    assert engine.stats().kv_cache_usage == 0.0
    engine.scheduler.check_integrity()
    # The engine goes on: a later request runs to the end.
    engine.add_request("later", [7, 8], GREEDY)
    deltas = _drain(engine)
    assert deltas["later"][-1].finish_reason == "length"
    assert sum(len(d.new_token_ids) for d in deltas["later"]) == 6


def test_stats_count_steps_and_prefix_hits(engine) -> None:
    prompt = list(range(3, 23))  # 20 tokens: 5 full blocks of 4
    engine.add_request("first", prompt, GREEDY)
    _drain(engine)
    engine.add_request("second", prompt, GREEDY)
    engine.step()
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= stats.prefix_cache_hits
    assert stats.last_step_num_tokens >= 1 and stats.last_step_seconds > 0
    assert stats.num_running == 1 and stats.num_waiting == 0
    _drain(engine)


def test_num_threads_is_applied(tiny_llama_dir) -> None:
    previous = torch.get_num_threads()
    try:
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
