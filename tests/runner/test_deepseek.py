"""DeepSeek-V2/V3 (multi-head latent attention, runner/mla.py) against transformers on tiny random checkpoints:
the real 512 + 64 latent and a small one, with and without the query's low-rank pair, YaRN with DeepSeek's
mscale keys; from Hugging Face directories and from GGUF files; and a cache of one latent row a token."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.runner import runner as runner_module
from serval.runner.mla import LatentAttention
from serval.runner.moe import SparseMoe
from serval.sampling import SamplingParams
from tests.runner.test_models import PROMPTS, _engine, _greedy, _serval_logits, assert_greedy_matches

DEEPSEEK = [
    "deepseek_v2",
    "deepseek_v2_q_lora",
    "deepseek_v3",
    "deepseek_v3_no_q_lora",
    "deepseek_v3_rope_halves",
]


def _assert_logits_match(engine: Engine, reference, ends=(1, None)) -> None:
    for prompt in PROMPTS:
        for end in ends:
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt[:end]])).logits[0, -1]
            assert (_serval_logits(engine, prompt[:end]) - theirs).abs().max().item() < 1e-3


@pytest.mark.parametrize("architecture", DEEPSEEK)
def test_logits_and_greedy_match_transformers(tiny_model_factory, architecture):
    directory, reference = tiny_model_factory(architecture, False)
    engine = _engine(directory)
    layers = engine.runner.model.layers
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in layers)
    # first_k_dense_replace=1: layer 0 dense, layer 1 sparse with DeepSeek's ungated shared experts
    assert not isinstance(layers[0].mlp, SparseMoe) and isinstance(layers[1].mlp, SparseMoe)
    assert layers[1].mlp.shared_experts is not None and layers[1].mlp.shared_expert is None
    _assert_logits_match(engine, reference, ends=(1, 5, None))
    assert_greedy_matches(engine, reference, PROMPTS, max_tokens=10)


@pytest.mark.parametrize("architecture", ["deepseek_v2", "deepseek_v3"])
def test_without_native_kernels_the_sdpa_backend_matches_transformers(
    tiny_model_factory, monkeypatch, architecture
):
    # No kernels built: PyTorch everywhere and SDPA's latent attention (a CUDA device's path today).
    monkeypatch.setattr(runner_module, "load_cpu_kernels", lambda *args, **kwargs: None)
    directory, reference = tiny_model_factory(architecture, False)
    engine = _engine(directory)
    assert engine.runner.attention_backend.name == "sdpa"
    _assert_logits_match(engine, reference)
    assert_greedy_matches(engine, reference, PROMPTS[:2], max_tokens=6)


def test_bf16_stays_near_fp32(tiny_model_factory):
    directory, reference = tiny_model_factory("deepseek_v3", False)
    engine = Engine(
        EngineConfig(model=ModelConfig(model=directory, dtype="bfloat16"), cache=CacheConfig(num_blocks=64))
    )
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        assert (_serval_logits(engine, prompt) - theirs).abs().max().item() < 0.05


@pytest.mark.parametrize("architecture", ["deepseek_v2", "deepseek_v2_q_lora"])
def test_the_cache_holds_one_latent_row_a_token(tiny_model_factory, architecture):
    directory, reference = tiny_model_factory(architecture, False)
    config = reference.config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    runner = _engine(directory).runner
    for k_cache, v_cache in runner.kv_caches:
        assert v_cache is k_cache  # one tensor: the value is the key row's first kv_lora_rank values
        assert k_cache.shape == (runner.num_blocks * runner.block_size, 1, latent)
    # The budget buys blocks at the latent's size: 4 bytes x latent per token and layer, nothing more.
    assert runner._bytes_per_block() == config.num_hidden_layers * runner.block_size * latent * 4


def test_batched_equals_alone(tiny_model_factory):
    directory, _ = tiny_model_factory("deepseek_v2", False)
    together = _greedy(_engine(directory), PROMPTS, max_tokens=10)
    assert together == [_greedy(_engine(directory), [prompt], max_tokens=10)[0] for prompt in PROMPTS]


@pytest.mark.parametrize("architecture", ["deepseek_v2", "deepseek_v3_no_q_lora"])
def test_a_prompt_split_by_chunks_or_a_prefix_hit_equals_one_pass(tiny_model_factory, architecture):
    directory, _ = tiny_model_factory(architecture, False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)

    def run(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float], int]]:
        """Each prompt's (tokens, their logprobs, prompt tokens served from the prefix cache), one after another:
        a later prompt may hit an earlier one's blocks."""
        results = []
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
            tokens, logprobs, cached = [], [], 0
            while engine.has_unfinished_requests():
                for output in engine.step():
                    tokens += output.new_token_ids
                    logprobs += [lp.logprob for lp in output.new_logprobs or []]
                    cached = output.num_cached_tokens
            results.append((tokens, logprobs, cached))
        return results

    prompt = PROMPTS[0]
    (whole,) = run(_engine(directory, block_size=4), [prompt])
    chunked_config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=5),
    )
    (chunked,) = run(Engine(chunked_config), [prompt])
    _, after_hit = run(_engine(directory, block_size=4), [prompt[:21], prompt])
    assert after_hit[2] == 20  # five whole blocks of the first prompt served from the cache
    # NOTE: tokens equal, logprobs within rounding: dense fp32 matmuls are not batch invariant (README); the
    # attention is (test_latent_attention.py), and so is a packed GGUF (test_deepseek_gguf.py).
    for split in (chunked, after_hit):
        assert split[0] == whole[0]
        assert max(abs(a - b) for a, b in zip(split[1], whole[1])) < 1e-5


@pytest.mark.parametrize("split_kv_b", [False, True])  # kv_b_proj whole, or as attn_k_b + attn_v_b
# NOTE: not deepseek_v3_rope_halves: llama.cpp rotates the checkpoint's pairs, so rope_interleave false has no
# GGUF form without a converter permuting rows (no released checkpoint says false).
@pytest.mark.parametrize("architecture", DEEPSEEK[:-1])
def test_gguf_matches_transformers(tiny_model_factory, tmp_path, architecture, split_kv_b):
    # llama.cpp's deepseek2 layout: MLA's attn_q_a/attn_kv_a_mqa/... names, leading_dense_block_count, the
    # expert_* keys, YaRN's mscale as yarn_log_multiplier. A file without experts cannot say V2 from V3 (their
    # dense layers compute the same); one with experts says it by its gating function.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(architecture, False)
    path = str(tmp_path / f"{architecture}.gguf")
    config = {**reference.config.to_dict(), "split_kv_b": split_kv_b}
    write_gguf_from_state_dict(path, config, reference.state_dict())
    engine = _engine(path)
    if engine.runner.arch.moe is not None:
        assert engine.runner.arch.architecture == reference.config.architectures[0]
    assert engine.runner.arch.mla == _engine_arch_mla(tiny_model_factory, architecture)
    _assert_logits_match(engine, reference)
    assert_greedy_matches(engine, reference, PROMPTS[:2], max_tokens=6)


def _engine_arch_mla(tiny_model_factory, architecture: str):
    directory, _ = tiny_model_factory(architecture, False)
    return _engine(directory).runner.arch.mla


def test_a_quantized_gguf_is_batch_invariant(tiny_model_factory, tmp_path):
    # Q8_0 matrices run packed (the invariant kernels): a prompt's greedy tokens and logprobs are bitwise the
    # same alone, beside others, in chunks and after a prefix-cache hit.
    from gguf import GGMLQuantizationType

    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory("deepseek_v2", False)
    path = str(tmp_path / "q8.gguf")
    write_gguf_from_state_dict(
        path, reference.config.to_dict(), reference.state_dict(), GGMLQuantizationType.Q8_0
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)

    def engine(**scheduler) -> Engine:
        return Engine(
            EngineConfig(
                model=ModelConfig(model=path),
                cache=CacheConfig(num_blocks=64, block_size=4),
                scheduler=SchedulerConfig(**scheduler),
            )
        )

    def run(
        e: Engine, prompts: list[list[int]], together: bool = False
    ) -> list[tuple[list[int], list[float]]]:
        results: dict[str, tuple[list[int], list[float]]] = {}
        for i, prompt in enumerate(prompts):
            e.add_request(str(i), prompt, params)
            results[str(i)] = ([], [])
            while not together and e.has_unfinished_requests():
                _collect(e, results)
        while e.has_unfinished_requests():
            _collect(e, results)
        return [results[str(i)] for i in range(len(prompts))]

    alone = [run(engine(), [prompt])[0] for prompt in PROMPTS]
    assert run(engine(), PROMPTS, together=True) == alone
    assert run(engine(max_num_batched_tokens=5), PROMPTS[:1]) == alone[:1]
    assert run(engine(), [PROMPTS[0][:21], PROMPTS[0]])[1] == alone[0]


def _collect(engine: Engine, results: dict) -> None:
    for output in engine.step():
        tokens, logprobs = results[output.request_id]
        tokens += output.new_token_ids
        logprobs += [lp.logprob for lp in output.new_logprobs or []]


def test_the_bench_shape_of_deepseek_v2_lite_writes_and_serves_down_scaled(tmp_path, monkeypatch):
    # bench/make_model.py's deepseek-v2-lite with its layer tables, metadata and 102400-token vocabulary, but
    # a tiny width: serval reads it as DeepSeek-V2 (a dense first layer, then 8 routed and 2 shared experts).
    import dataclasses
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    from make_model import WEIGHT_TYPES, write_model
    from model_shapes import DEEPSEEK_V2_LITE, SHAPES, MlaShape

    assert SHAPES["deepseek-v2-lite"] is DEEPSEEK_V2_LITE
    shape = dataclasses.replace(
        DEEPSEEK_V2_LITE, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=2, num_kv_heads=2,
        num_experts=8, num_experts_used=2, expert_intermediate_size=32, mla=MlaShape(512, 32, 64, 32),
    )  # fmt: skip
    path = str(tmp_path / "deepseek-v2-lite-small.gguf")
    write_model(path, shape, WEIGHT_TYPES["Q8_0"], seed=0)
    engine = Engine(EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(num_blocks=16)))
    arch = engine.runner.arch
    assert (arch.architecture, arch.vocab_size, arch.num_layers) == ("DeepseekV2ForCausalLM", 102400, 3)
    assert (arch.mla.kv_lora_rank, arch.mla.qk_nope_head_dim, arch.mla.v_head_dim, arch.mla.q_lora_rank) == (
        512, 32, 32, None,
    )  # fmt: skip
    assert arch.moe.dense_layers == {0} and arch.moe.top_k == 2
    assert arch.moe.shared_experts_intermediate_size == 64
    assert engine.runner.kv_caches[0][0].shape[1:] == (1, 576)
    (tokens,) = _greedy(engine, [PROMPTS[1]], max_tokens=4)
    assert len(tokens) == 4


def test_the_q4_k_m_plan_falls_back_where_k_quant_blocks_do_not_divide_a_row(monkeypatch):
    # DeepSeek-V2-Lite's ffn_down rows (10944 dense, 1408 an expert) are not whole 256-value super-blocks:
    # llama-quantize writes them Q5_0 (Q4_K's fallback) and Q8_0 (Q6_K's); a truncated row would be a file
    # neither server reads.
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    from make_model import WEIGHT_TYPES, plan_tensors, use_more_bits
    from model_shapes import DEEPSEEK_V2_LITE

    plans = {p.name: p for p in plan_tensors(DEEPSEEK_V2_LITE, 102400, WEIGHT_TYPES["Q4_K_M"])}
    assert use_more_bits(0, 27) and not use_more_bits(4, 27)
    assert plans["blk.0.ffn_down.weight"].qtype == Q.Q8_0  # Q6_K in a more-bits layer
    assert plans["blk.26.ffn_down_exps.weight"].qtype == Q.Q8_0
    assert plans["blk.4.ffn_down_exps.weight"].qtype == Q.Q5_0
    assert plans["blk.4.ffn_gate_exps.weight"].qtype == Q.Q4_K  # 2048-wide rows keep the k-quant
    assert plans["blk.4.ffn_down_exps.weight"].byte_shape == (64, 2048, 1408 // 32 * 22)


def test_lora_is_refused_at_start_up(tiny_model_factory):
    from serval.config import LoraConfig

    directory, _ = tiny_model_factory("deepseek_v2", False)
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=16),
        lora=LoraConfig(enable_lora=True),
    )
    with pytest.raises(ValueError, match="LoRA adapters are not supported for DeepseekV2ForCausalLM"):
        Engine(config)
