"""Deterministic mode through the real server: the same request gives the same bytes whatever
else runs with it.

A server in deterministic mode with a 512-token budget answers 64 different completions one at a
time (the reference); a second one, with a random budget (printed) that cuts the prompts into
other chunks, answers all 64 at once, half streamed, a quarter sampled with a seed: each one's
text, tokens and logprobs are equal to its reference. 16 identical greedy requests at once give
one text, the reference's. ``deterministic: true`` in a request is refused by a server not in
deterministic mode.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

NUM_PROMPTS = 64
MAX_TOKENS = 8


def _bodies() -> list[dict[str, Any]]:
    text = "the city river boat harbour paris france capital light sound water sun moon"
    words = text.split(" ")
    rng = random.Random(11)
    bodies = []
    for index in range(NUM_PROMPTS):
        body: dict[str, Any] = {
            "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(3, 60))),
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "logprobs": 2,
            "temperature": 0.0,
            "deterministic": True,
        }
        if index % 4 == 3:
            body.update(temperature=1.0, seed=index)
        bodies.append(body)
    return bodies


async def _complete(client: httpx.AsyncClient, body: dict[str, Any], stream: bool) -> dict:
    """Text and logprobs of one completion, streamed or not."""
    if not stream:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return {"text": choice["text"], "logprobs": choice["logprobs"]}
    text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            for key in logprobs:
                logprobs[key] += (choice["logprobs"] or {}).get(key, [])
    return {"text": text, "logprobs": logprobs}


def _comparable(result: dict) -> dict:
    """The fields a streamed and a whole answer share."""
    logprobs = result["logprobs"]
    keys = ("tokens", "token_logprobs", "top_logprobs")
    return {"text": result["text"], **{key: logprobs[key] for key in keys}}


async def _alone(url: str, bodies: list[dict[str, Any]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return [_comparable(await _complete(client, body, stream=False)) for body in bodies]


async def _together(url: str, bodies: list[dict[str, Any]], stream: list[bool]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        results = await asyncio.gather(
            *(_complete(client, body, s) for body, s in zip(bodies, stream, strict=True))
        )
    return [_comparable(result) for result in results]


def test_same_bytes_alone_and_together(start_server):
    budget = random.randint(8, 96)
    print(f"max_batch_tokens of the concurrent server: {budget}")
    reference = start_server(engine={"deterministic": True})
    loaded = start_server(engine={"deterministic": True, "max_batch_tokens": budget})
    bodies = _bodies()
    alone = asyncio.run(_alone(reference.url, bodies))
    stream = [index % 2 == 0 for index in range(NUM_PROMPTS)]
    together = asyncio.run(_together(loaded.url, bodies, stream))
    for index, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert got == want, (index, budget)
    identical = asyncio.run(_together(loaded.url, [bodies[0]] * 16, [False] * 8 + [True] * 8))
    assert {json.dumps(result) for result in identical} == {json.dumps(alone[0])}, budget


def test_deterministic_field_needs_a_deterministic_server(tiny_server, start_server):
    body = {"prompt": "the city", "max_tokens": 2, "deterministic": True}
    refused = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "deterministic"
    assert "--deterministic" in refused.json()["error"]["message"]
    allowed = {**body, "deterministic": False}
    assert httpx.post(tiny_server.url + "/v1/completions", json=allowed).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    chat.pop("prompt")
    assert httpx.post(tiny_server.url + "/v1/chat/completions", json=chat).status_code == 400
    deterministic = start_server(engine={"deterministic": True})
    assert httpx.post(deterministic.url + "/v1/completions", json=body).status_code == 200
    assert httpx.post(deterministic.url + "/v1/chat/completions", json=chat).status_code == 200
