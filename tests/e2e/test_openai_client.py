"""The official ``openai`` client against a real server (tiny model, float32)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from server.runner import ServerThread


@pytest.fixture(scope="module")
def client(tiny_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_completion_usage_matches_the_tokenizer(
    client: openai.OpenAI, model: str, tiny_tokenizer: Any
) -> None:
    prompt = "The capital of France is"
    result = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=7,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )  # type: ignore[call-arg]
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    choice = result.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt))
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7
    assert len(choice.logprobs.tokens) == 7
    assert choice.text == "".join(choice.logprobs.tokens)
    # Greedy: the sampled token is the most likely one.
    for token, logprob, top in zip(
        choice.logprobs.tokens,
        choice.logprobs.token_logprobs,
        choice.logprobs.top_logprobs,
        strict=True,
    ):
        assert logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)
        assert token in top


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert len({chunk.id for chunk in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_completion_and_stream(client: openai.OpenAI, model: str, tiny_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    template = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt_ids = tiny_tokenizer.apply_chat_template(
        template, tokenize=False, add_generation_prompt=True
    )
    assert whole.usage.prompt_tokens == len(
        tiny_tokenizer.encode(prompt_ids, add_special_tokens=False)
    )
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_2_sampled_and_streamed(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(
        model=model,
        prompt="The weather today",
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )  # type: ignore[call-arg]
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.choices[0].text != result.choices[1].text  # distinct samples
    assert result.usage.completion_tokens == 16
    again = client.completions.create(
        model=model,
        prompt="The weather today",
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )  # type: ignore[call-arg]
    assert [c.text for c in again.choices] == [c.text for c in result.choices]  # seeded
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=5,
            stream=True,
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_stop_string_is_not_emitted(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )  # type: ignore[call-arg]
    text = base.choices[0].text
    assert len(text) > 6
    stop = text[3:6]  # falls inside or across tokens
    cut = text[: text.index(stop)]
    result = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=20, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == cut
    assert result.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        stop=stop,
        stream=True,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    result = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count: one, two"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert isinstance(entry.bytes, list)
    joined = b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace")
    assert joined.startswith(result.choices[0].message.content.rstrip("\ufffd")[:1])


def test_prompt_as_token_ids_and_batches(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(
        model=model,
        prompt=[[10, 11, 12], [20, 21]],
        max_tokens=3,
        temperature=0,
        echo=True,
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert result.usage.prompt_tokens == 5
    many = client.completions.create(model=model, prompt=["a b", "c d", "e f"], max_tokens=2)
    assert len(many.choices) == 3


def test_tokenize_and_detokenize(tiny_server: ServerThread, tiny_tokenizer: Any) -> None:
    import httpx

    with httpx.Client(base_url=tiny_server.url) as http:
        tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert tokens["tokens"] == tiny_tokenizer.encode("Hello world")
        assert tokens["count"] == len(tokens["tokens"])
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert text["prompt"] == "Hello world"
