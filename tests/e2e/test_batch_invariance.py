"""Batch invariance through the real server with its default flags and concurrent `openai` clients: a greedy
chat request's tokens and logprobs come back bitwise the same alone and while 15 other requests of other
lengths stream beside it (docs/architecture.md)."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import running_server

PROBES = ["Name three rivers in Europe.", "Write a limerick about a cat. " * 3]
OTHERS = [f"Count from {i} to {i + 20}, one number a line." * (1 + i % 4) for i in range(15)]


async def _ask(client, model: str, prompt: str) -> list[tuple]:
    response = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=24,
        logprobs=True,
        top_logprobs=2,
    )
    return [
        (entry.token, entry.logprob, [(top.token, top.logprob) for top in entry.top_logprobs])
        for entry in response.choices[0].logprobs.content
    ]


async def _alone_then_together(base_url: str, model: str) -> tuple[list, list]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    alone = [await _ask(client, model, prompt) for prompt in PROBES]
    together = await asyncio.gather(*(_ask(client, model, p) for p in OTHERS[:8] + PROBES + OTHERS[8:]))
    return alone, together[8:10]


@pytest.mark.slow
def test_a_request_answers_the_same_alone_and_beside_concurrent_clients(tmp_path):
    with running_server(["--log-level", "warning"], tmp_path / "server.log") as server:
        alone, together = asyncio.run(_alone_then_together(server.base_url, server.served_model()))
    assert all(len(answer) == 24 for answer in alone)
    assert together == alone
