"""Offline generation (``LLM.generate``) and the ``splitfuse generate`` / ``model`` commands."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from server.cli import main

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)


def test_text_and_token_prompts_give_the_same_result(llm) -> None:
    text = "The capital of France is"
    token_ids = llm.tokenizer.encode(text)
    by_text, by_ids = llm.generate([text, token_ids], GREEDY)
    assert by_text.prompt == text and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == token_ids
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 12
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    assert by_text.finish_reason == "length"
    (single,) = llm.generate(text, GREEDY)  # one string is one prompt
    assert single.token_ids == by_text.token_ids
    (flat,) = llm.generate(token_ids, GREEDY)  # one list of ints is one prompt
    assert flat.token_ids == by_text.token_ids


def test_results_keep_prompt_order_and_their_own_params(llm) -> None:
    prompts = ["one two three", "Once upon a time", "def add(a, b):"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    results = llm.generate(prompts, params)
    assert [r.prompt for r in results] == prompts
    assert [len(r.token_ids) for r in results] == [3, 9, 5]
    alone = [llm.generate(p, q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in results] == alone


def test_stop_strings_cut_the_text(llm) -> None:
    (full,) = llm.generate("Once upon a time", GREEDY)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text
    (stopped,) = llm.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert len(stopped.token_ids) < len(full.token_ids)
    assert not llm.engine.has_unfinished_requests()


def test_n_sequences_and_logprobs(llm) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=1, logprobs=2)
    (result,) = llm.generate("Hello", params)
    assert len(result.outputs) == 3
    for output in result.outputs:
        assert len(output.token_ids) == len(output.logprobs) == 8 or output.finish_reason == "stop"
        assert all(len(lp.top) == 2 for lp in output.logprobs)


def test_bad_input_raises_and_leaves_the_engine_idle(llm) -> None:
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([])
    with pytest.raises(ValueError, match="outside"):
        llm.generate([[5, 6], [5, 10**6]], GREEDY)
    assert not llm.engine.has_unfinished_requests()  # the first prompt was withdrawn


def test_generate_command_streams_only_the_text(llm, tiny_llama_dir, capsys) -> None:
    (expected,) = llm.generate("Once upon a time", GREEDY)
    argv = ["generate", "Once upon a time", str(tiny_llama_dir), "--max-tokens", "12"]
    assert main([*argv, "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    # greedy without ignore_eos: the same text, unless an EOS ended it earlier
    assert expected.text.startswith(captured.out.removesuffix("\n"))
    assert captured.out.endswith("\n")


def test_generate_command_chat_and_errors(tiny_llama_dir, capsys) -> None:
    argv = ["generate", "hi", str(tiny_llama_dir), "--chat", "--max-tokens", "4"]
    assert main([*argv, "--dtype", "float32"]) == 0
    assert main(["generate", "hi", "no-such-model"]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "hi", str(tiny_llama_dir), "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err


def test_model_prepare_command_reports_errors(capsys) -> None:
    assert main(["model", "prepare", "--gguf", "/no/such/file.gguf", "--name", "x"]) == 1
    assert "GGUF file not found" in capsys.readouterr().err
