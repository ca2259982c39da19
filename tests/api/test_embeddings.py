"""POST /v1/embeddings on a tiny random-weight Qwen3 embedding checkpoint (written by sentence-transformers
itself), through the official openai SDK against a real server on loopback and the real engine: the vectors
equal sentence-transformers' on the same weights (last-token pooling, normalized; mean pooling unnormalized),
token-id inputs, `dimensions` (a renormalized prefix), base64; a generative model refuses with a 400; every KV
block is free after each request."""

from __future__ import annotations

import base64
import struct

import numpy as np
import openai
import pytest

from serval.api.app import build_app
from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.client import EngineClient
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.tokenizer import Tokenizer
from tests.fixtures.inprocess_server import serving
from tests.fixtures.tiny_embedding import write_tiny_embedding_model

MODEL = "tiny-embed"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "once upon a time"]


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _serve(directory: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")  # nothing to compile for a 2-layer model
        config = EngineConfig(
            model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=64)
        )
        engine = EngineClient.start(config)
    try:
        frontend = Frontend(engine, Tokenizer.from_directory(directory))
        with serving(build_app(ServerConfig(served_model_names=(MODEL,)), frontend)) as port:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
            )
            yield client, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=[("lasttoken", True), ("mean", False)], ids=["lasttoken", "mean"])
def embedder(request, tmp_path_factory):
    pooling, normalize = request.param
    directory, reference = write_tiny_embedding_model(str(tmp_path_factory.mktemp(f"embed-{pooling}")), pooling,
                                                      normalize)  # fmt: skip
    for client, engine in _serve(directory):
        yield client, engine, reference, normalize


def _all_blocks_free(engine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks


def test_vectors_equal_sentence_transformers(embedder):
    client, engine, reference, normalize = embedder
    expected = reference.encode(TEXTS)
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL
    for got, want in zip(response.data, expected):
        assert _cosine(got.embedding, want) >= 0.9999
        if normalize:
            assert abs(np.linalg.norm(got.embedding) - 1.0) < 1e-5
    ids = [reference.tokenizer(text)["input_ids"] for text in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    # one string, and token ids, give the same vectors
    single = client.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding
    assert _cosine(single, expected[1]) >= 0.9999
    by_ids = client.embeddings.create(model=MODEL, input=ids).data
    assert all(_cosine(d.embedding, w) >= 0.9999 for d, w in zip(by_ids, expected))
    assert (
        _cosine(client.embeddings.create(model=MODEL, input=ids[0]).data[0].embedding, expected[0]) >= 0.9999
    )
    assert _all_blocks_free(engine)


def test_dimensions_and_base64(embedder):
    client, engine, reference, normalize = embedder
    expected = reference.encode(TEXTS, truncate_dim=16)
    response = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16)
    for got, want in zip(response.data, expected):
        assert len(got.embedding) == 16 and _cosine(got.embedding, want) >= 0.9999
        if normalize:
            assert abs(np.linalg.norm(got.embedding) - 1.0) < 1e-5
    # base64: little-endian float32, as OpenAI's
    encoded = (
        client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    )
    raw = base64.b64decode(encoded)
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert decoded == client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    assert _cosine(decoded, reference.encode([TEXTS[0]])[0]) >= 0.9999
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=65)
    assert error.value.body["param"] == "dimensions"
    assert _all_blocks_free(engine)


HOSTILE = [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[1], ["a"]]}, "input"),
    ({"input": [[10**9]]}, "input"),
    ({"input": [[-1]]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": None}, "input"),
    ({"input": "x " * 5000}, "input"),  # past the context
    ({"input": ["a"] * 3000}, "input"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": "8"}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "model": "other"}, "model"),
]


def test_hostile_inputs_are_400s_and_free_every_block(embedder):
    client, engine, _, _ = embedder
    import httpx

    url = str(client.base_url) + "embeddings"
    for body, param in HOSTILE:
        response = httpx.post(url, json={"model": MODEL, **body}, timeout=60)
        assert 400 <= response.status_code < 500, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    assert client.embeddings.create(model=MODEL, input="still serving").data
    assert _all_blocks_free(engine)


def test_a_generative_model_refuses(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3")
    for client, _ in _serve(directory):
        with pytest.raises(openai.BadRequestError) as error:
            client.embeddings.create(model=MODEL, input="hi")
        assert "not an embedding model" in error.value.body["message"]
