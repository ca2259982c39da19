"""Narrower KV caches (`kv_cache_dtype="bfloat16"` under fp32 compute, `"fp8_e5m2"` and `"int8"`) through the
whole engine on tiny random-weight models: the native backend (its fused decode included) gives the SDPA
reference backend's greedy tokens, logprobs within fp32 rounding, over the same rounded cache; a request's
tokens are bitwise the same alone or beside others in chunked, mixed steps; the cache holds the tokens its
bytes allow and frees every block; the rounding is real (logprobs move off the 32-bit cache's) and bounded,
bf16 closer than int8 rows, int8 closer than e5m2; the Triton backend, which reads int8 rows or the model's
dtype, is refused with fp8 and with bf16 under fp32 compute at start-up."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig
from serval.runner.attention.cache_dtype import kv_cache_dtype
from tests.engine.chunked_waves import (
    FIRST_WAVE,
    PARAMS,
    chunking_engine,
    generate_with_prefix_hit,
    run_waves,
)
from tests.fixtures.kernels import require_kernels
from tests.fixtures.triton_interpreter import triton_interpreter  # noqa: F401 (a fixture)

KINDS = ["bfloat16", "fp8_e5m2", "int8"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("architecture", ["llama", "gpt_oss"])  # gpt-oss: sliding windows, sink logits
def test_the_native_backend_matches_the_sdpa_backend_over_a_narrower_cache(
    tiny_model_factory, architecture, kind
):
    require_kernels()
    directory, _ = tiny_model_factory(architecture, False)
    expected = generate_with_prefix_hit(directory, "sdpa", kind)
    got = generate_with_prefix_hit(directory, "native-cpu", kind)
    for request_id, (tokens, logprobs) in expected.items():
        assert len(tokens) == PARAMS.max_tokens
        assert got[request_id][0] == tokens, request_id
        assert max(abs(a - b) for a, b in zip(got[request_id][1], logprobs)) < 1e-4, request_id


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_is_answered_alike_alone_or_batched(tiny_model_factory, dtype, kind):
    require_kernels()
    directory, _ = tiny_model_factory("llama", False)
    engine = chunking_engine(directory, "native-cpu", kind, dtype)
    together = run_waves(engine, [FIRST_WAVE])
    for request_id, prompt in FIRST_WAVE.items():
        alone = run_waves(engine, [{request_id: prompt}])
        assert alone[request_id] == together[request_id], request_id


def test_the_narrower_caches_hold_more_tokens_and_round_within_bounds(tiny_model_factory):
    require_kernels()
    directory, _ = tiny_model_factory("llama", False)
    budget = {"kv_cache_memory_bytes": 4 << 20}
    engines = {kind: chunking_engine(directory, "native-cpu", kind, **budget) for kind in ["auto", *KINDS]}
    runner = engines["auto"].runner
    spec = runner.model.kv_cache_spec(runner.arch)
    dtypes = [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int8]
    assert [engines[k].runner.kv_caches[0][0].dtype for k in engines] == dtypes
    assert [engines[k].runner.info.cache_dtype for k in engines] == [
        str(d).removeprefix("torch.") for d in dtypes
    ]

    def blocks_of(
        bytes_a_value: int, row_width: int
    ) -> int:  # K and V rows of every kv head, 4 tokens a block
        return (4 << 20) // (runner.arch.num_layers * 4 * 2 * spec.num_kv_heads * row_width * bytes_a_value)

    blocks = {kind: engine.runner.info.num_blocks for kind, engine in engines.items()}
    assert blocks == {
        "auto": blocks_of(4, spec.head_dim),
        "bfloat16": blocks_of(2, spec.head_dim),
        "fp8_e5m2": blocks_of(1, spec.head_dim),
        "int8": blocks_of(1, spec.head_dim + 4),  # an int8 row ends in its 4-byte scale
    }
    exact = run_waves(engines["auto"], [FIRST_WAVE])
    worst = {}
    for kind in KINDS:
        rounded = run_waves(engines[kind], [FIRST_WAVE])
        worst[kind] = max(_logprob_differences(exact[r], rounded[r]) for r in FIRST_WAVE)
    # Rounded K and V move the logprobs (a cache that kept the values would not), but not far on this model:
    # a bound that an unrounded read or a wrong widening (a misplaced byte, a lost scale) breaks. bf16 keeps 8
    # significant bits a value, int8 rows ~7 against their largest value, e5m2 3.
    assert 1e-6 < worst["bfloat16"] < worst["int8"] < worst["fp8_e5m2"] < 0.1, worst


def _logprob_differences(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> float:
    """The largest |logprob difference| while both answers agree (after a differing token they compare
    different continuations)."""
    worst = 0.0
    for token_a, token_b, logprob_a, logprob_b in zip(a[0], b[0], a[1], b[1]):
        worst = max(worst, abs(logprob_a - logprob_b))
        if token_a != token_b:
            break
    return worst


def test_the_triton_backend_is_refused_with_an_fp8_cache(tiny_model_factory, triton_interpreter):  # noqa: F811
    directory, _ = tiny_model_factory("llama", False)
    for kind in ("fp8_e5m2", "bfloat16"):  # bf16 under fp32 compute: not the model's dtype
        with pytest.raises(ValueError, match="native-cpu and sdpa"):
            chunking_engine(directory, "triton", kind)
    assert (
        chunking_engine(directory, "triton", "int8").runner.attention_backend.name == "triton"
    )  # test_triton_engine.py


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4", "float16"])
def test_other_cache_dtypes_are_refused(name):
    with pytest.raises(ValueError, match="fp8_e5m2"):
        CacheConfig(kv_cache_dtype=name)


def test_fp8_names_e5m2_as_vllms_cpu_backend_takes_it():
    assert (
        kv_cache_dtype("fp8", torch.bfloat16)
        == kv_cache_dtype("fp8_e5m2", torch.float32)
        == torch.float8_e5m2
    )
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("kind", KINDS)
def test_latent_attention_over_an_8bit_cache(tiny_model_factory, kind):
    """DeepSeek's MLA caches one 576-wide latent row a token (its value the first 512): the same batch invariance
    and bounded rounding over an 8-bit cache."""
    require_kernels()
    directory, _ = tiny_model_factory("deepseek_v2", False)
    engine = chunking_engine(directory, "native-cpu", kind)
    together = run_waves(engine, [FIRST_WAVE])
    for request_id, prompt in FIRST_WAVE.items():
        assert run_waves(engine, [{request_id: prompt}])[request_id] == together[request_id], request_id
    exact = run_waves(chunking_engine(directory, "native-cpu", "auto"), [FIRST_WAVE])
    worst = max(_logprob_differences(exact[r], together[r]) for r in FIRST_WAVE)
    assert 1e-6 < worst < 0.1


def test_an_int8_latent_cache_is_refused_on_the_sdpa_backend(tiny_model_factory):
    directory, _ = tiny_model_factory("deepseek_v2", False)
    with pytest.raises(ValueError, match="MLA"):
        chunking_engine(directory, "sdpa", "int8")
