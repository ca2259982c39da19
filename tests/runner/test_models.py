"""Each architecture against Hugging Face transformers on tiny random-weight safetensors checkpoints."""

from __future__ import annotations

import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch
from serval.sampling import SamplingParams
from tests.conftest import ARCHITECTURES

PROMPTS = [list(range(3, 40)), [7, 99, 250, 13, 13, 13, 5], list(range(300, 340, 2))]


def _engine(directory: str, **cache) -> Engine:
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=64, **cache)
    )
    return Engine(config)


def _serval_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    # All positions' logits would need every row; the last row is what sampling uses, so compare that,
    # and compare intermediate rows by running the prompt's prefixes.
    num_blocks = -(-len(prompt) // engine.runner.block_size)
    batch = Batch(prompt, [len(prompt)], [0], [list(range(num_blocks))], [0], [])
    return engine.runner.compute_logits(batch)[0]


def _greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_match_transformers(tiny_model_factory, architecture, tied):
    directory, reference = tiny_model_factory(architecture, tied)
    engine = _engine(directory)
    for prompt in PROMPTS:
        for end in (1, len(prompt) // 2, len(prompt)):
            ours = _serval_logits(engine, prompt[:end])
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt[:end]])).logits[0, -1]
            assert (ours - theirs).abs().max().item() < 1e-3


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_matches_transformers(tiny_model_factory, architecture):
    directory, reference = tiny_model_factory(architecture, False)
    assert_greedy_matches(_engine(directory), reference, PROMPTS, max_tokens=12)


def assert_greedy_matches(engine: Engine, reference, prompts: list[list[int]], max_tokens: int) -> None:
    """The engine's greedy tokens for the prompts (batched) are transformers' generate() for each alone."""
    ours = _greedy(engine, prompts, max_tokens=max_tokens)
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        assert tokens == out[0, len(prompt) :].tolist()


def test_sliding_window_matches_transformers_in_prefill_and_the_decode_stack(tiny_model_factory):
    # Every layer sees the last 6 positions (Mistral v0.1's config); decodes run in the native DecodeStack.
    directory, reference = tiny_model_factory("mistral_sliding", False)
    engine = _engine(directory)
    assert engine.runner.model.decode_stack is not None
    assert {layer.self_attn.window for layer in engine.runner.model.layers} == {6}
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        assert (_serval_logits(engine, prompt) - theirs).abs().max().item() < 1e-3
    assert_greedy_matches(engine, reference, PROMPTS, max_tokens=12)


def test_chunked_prefill_and_decode_agree_with_whole_prompt(tiny_model_factory):
    # A budget of 5 tokens per step forces every prompt through several chunks, with decodes in between.
    directory, _ = tiny_model_factory("qwen2", False)
    whole = _greedy(_engine(directory), PROMPTS, max_tokens=10)
    from serval.config import SchedulerConfig

    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=5),
    )
    chunked = _greedy(Engine(config), PROMPTS, max_tokens=10)
    assert chunked == whole


def test_llama3_rope_scaling_changes_logits(tiny_model_factory):
    # The llama3 fixture shares llama's weights; if scaling were ignored their logits would be equal.
    llama_dir, _ = tiny_model_factory("llama", False)
    llama3_dir, _ = tiny_model_factory("llama3", False)
    prompt = list(range(3, 120))
    a = _serval_logits(_engine(llama_dir), prompt)
    b = _serval_logits(_engine(llama3_dir), prompt)
    assert (a - b).abs().max().item() > 1e-3


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_gguf_checkpoint_matches_transformers(tiny_model_factory, tmp_path, architecture):
    # The same random weights written as an F32 GGUF (llama.cpp's layout) load to the same logits.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(architecture, False)
    path = str(tmp_path / f"{architecture}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict())
    engine = _engine(path)
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        assert (_serval_logits(engine, prompt) - theirs).abs().max().item() < 1e-3
    ours = _greedy(engine, PROMPTS[:1], max_tokens=8)[0]
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([PROMPTS[0]]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert ours == out[0, len(PROMPTS[0]) :].tolist()


def test_sharded_safetensors_checkpoint_loads(tiny_model_factory, tmp_path):
    _, reference = tiny_model_factory("llama", False)
    reference.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = _engine(str(tmp_path))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert (_serval_logits(engine, PROMPTS[0]) - theirs).abs().max().item() < 1e-3
