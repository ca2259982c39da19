"""logit_bias through the real server and the real `openai` SDK: +100 forces a token (greedy, sampled,
streamed, on /v1/completions), -100 bans the greedy one, the logprobs reported include the bias, and bad keys
and roles are typed 400s naming them."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

# A real server process with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _tokenize(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"]


def _detokenize(server, token_ids: list[int]) -> str:
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": token_ids}, timeout=30).json()[
        "prompt"
    ]


@pytest.fixture(scope="module")
def forced(server) -> tuple[int, str]:
    """A token no answer to QUESTION starts with, and the text of four of it in a row."""
    token_id = _tokenize(server, "Hello")[0]
    return token_id, _detokenize(server, [token_id] * 4)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "sampled"]
)
def test_plus_100_forces_a_token(openai_client, server, forced, sampling):
    token_id, expected = forced
    plain = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=4, **sampling
    )
    assert plain.choices[0].message.content != expected
    response = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=4, logit_bias={str(token_id): 100}, **sampling
    )
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "length"


def test_plus_100_forces_a_token_in_a_stream_and_on_completions(openai_client, server, forced):
    token_id, expected = forced
    stream = openai_client.chat.completions.create(
        model=server.model, messages=QUESTION, max_tokens=4, temperature=0, stream=True,
        logit_bias={str(token_id): 100},
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    completion = openai_client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=4, temperature=0,
        logit_bias={str(token_id): 100},
    )  # fmt: skip
    assert completion.choices[0].text == expected


def test_minus_100_bans_the_greedy_token_and_logprobs_show_the_bias(openai_client, server):
    def first_token(**fields):
        response = openai_client.chat.completions.create(
            model=server.model, messages=QUESTION, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5,
            **fields,
        )  # fmt: skip
        return response.choices[0].logprobs.content[0]

    plain = first_token()
    token_ids = _tokenize(server, plain.token)
    assert len(token_ids) == 1 and _detokenize(server, token_ids) == plain.token, (plain.token, token_ids)
    runner_up = plain.top_logprobs[1]
    banned = first_token(logit_bias={str(token_ids[0]): -100})
    assert banned.token == runner_up.token != plain.token
    assert plain.token not in [t.token for t in banned.top_logprobs]
    # The logprobs are taken after the bias (as OpenAI's): with the top token gone, the runner-up's probability
    # is renormalised over what is left.
    expected = runner_up.logprob - math.log1p(-math.exp(plain.logprob))
    assert math.isclose(banned.logprob, expected, abs_tol=1e-2), (banned.logprob, expected, plain.logprob)


def test_bad_key_and_bad_role_are_typed_400s(openai_client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model=server.model, messages=QUESTION, logit_bias={"abc": 1})
    assert bad.value.body["param"] == "logit_bias" and "'abc'" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(
            model=server.model, messages=QUESTION, logit_bias={"999999999": -5}
        )
    assert bad.value.body["param"] == "logit_bias" and "'999999999'" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(
            model=server.model, messages=[{"role": "developer", "content": "Be brief."}, *QUESTION]
        )
    assert bad.value.body["param"] == "messages[0].role"
