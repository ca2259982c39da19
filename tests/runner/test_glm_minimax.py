"""GLM-4 (Glm4ForCausalLM), GLM-4.5 (Glm4MoeForCausalLM) and MiniMax-M2 against transformers on tiny random
checkpoints, as safetensors and as llama.cpp's GGUF; the native expert kernel against the PyTorch path on the
same packed weights; a sequence's greedy tokens alone and beside others."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.moe import SparseMoe
from tests.runner.test_models import PROMPTS, _engine, _greedy, _serval_logits, assert_greedy_matches

FAMILIES = ["glm4", "glm4_moe", "minimax_m2"]
MOE_FAMILIES = ["glm4_moe", "minimax_m2"]


def _packed_engine(path: str, batch_activations: str = "float32") -> Engine:
    model = ModelConfig(model=path, batch_activations=batch_activations)
    return Engine(EngineConfig(model=model, cache=CacheConfig(num_blocks=64)))


def _max_error(engine: Engine, reference, prompt: list[int]) -> float:
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0, -1]
    return (_serval_logits(engine, prompt) - theirs).abs().max().item()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_model_factory, family, tied):
    directory, reference = tiny_model_factory(family, tied)
    engine = _engine(directory)
    assert engine.runner.arch.architecture == reference.config.architectures[0]
    for prompt in PROMPTS:
        for end in (1, len(prompt) // 2, len(prompt)):
            assert _max_error(engine, reference, prompt[:end]) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(tiny_model_factory, family):
    directory, reference = tiny_model_factory(family, False)
    assert_greedy_matches(_engine(directory), reference, PROMPTS, max_tokens=12)


def test_the_families_facts_are_read(tiny_model_factory):
    glm4 = _engine(tiny_model_factory("glm4", False)[0]).runner.arch
    assert (glm4.rope_dim, glm4.rope_interleaved, glm4.attention_bias, glm4.o_proj_bias) == (
        16,
        True,
        True,
        False,
    )
    glm4_moe = _engine(tiny_model_factory("glm4_moe", False)[0]).runner
    assert glm4_moe.arch.rope_dim == 16 and glm4_moe.arch.qk_norm and not glm4_moe.arch.rope_interleaved
    layers = glm4_moe.model.layers
    assert not isinstance(layers[0].mlp, SparseMoe)  # first_k_dense_replace=1
    sparse = layers[1].mlp
    assert isinstance(sparse, SparseMoe) and sparse.shared_experts is not None and sparse.num_groups == 4
    minimax = _engine(tiny_model_factory("minimax_m2", False)[0]).runner
    assert minimax.arch.rope_dim == 16 and minimax.arch.qk_norm_over_heads
    assert minimax.model.layers[0].self_attn.q_norm.weight.shape == (4 * 32,)


def test_glm4_moe_skips_its_multi_token_prediction_layer(tiny_model_factory, tmp_path):
    # GLM-4.5's checkpoints carry layer num_hidden_layers (the MTP module): loaded past, not an error.
    import shutil

    from safetensors.torch import load_file, save_file

    directory, reference = tiny_model_factory("glm4_moe", False)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{directory}/{name}", tmp_path / name)
    weights = load_file(f"{directory}/model.safetensors")
    extra = {
        "model.layers.3.eh_proj.weight": torch.randn(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.self_attn.q_proj.weight": torch.randn(128, 64),
    }
    save_file({**weights, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert _max_error(_engine(str(tmp_path)), reference, PROMPTS[0]) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_matches_transformers(tiny_model_factory, tmp_path, family):
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(family, False)
    path = str(tmp_path / f"{family}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict())
    engine = _engine(path)
    assert engine.runner.arch.architecture == reference.config.architectures[0]
    for prompt in PROMPTS:
        assert _max_error(engine, reference, prompt) < 1e-3
    assert_greedy_matches(engine, reference, PROMPTS[:2], max_tokens=8)


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0], ids=lambda t: t.name
)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_experts_run_natively_and_agree_with_the_pytorch_path(
    tiny_model_factory, tmp_path, family, qtype
):
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(family, False)
    path = str(tmp_path / f"{family}-{qtype.name}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict(), qtype)
    engine = _packed_engine(path)
    if engine.runner.kernel_variant == "none":
        pytest.skip("no native kernels on this machine")
    sparse = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoe)]
    assert sparse and all(m.native_kernel is not None and m.router_kernel is not None for m in sparse)
    assert engine.runner.model.decode_stack is None  # partial RoPE, sigmoid routers: layer by layer
    torch.manual_seed(0)
    for moe in sparse:
        for num_tokens in (1, 5, 33):
            x = torch.randn(num_tokens, reference.config.hidden_size, dtype=moe.gate.weight.dtype)
            ids, weights = moe.route(x)
            exact = moe.experts_reference(x, ids, weights)
            if moe.shared_experts is not None:
                exact = exact + moe.shared_experts(x).float()
            error = (moe(x) - exact).abs().max().item()
            assert error < 2e-3 * exact.abs().max().item(), num_tokens
    dense = Engine(
        EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(num_blocks=64))
    )
    for prompt in PROMPTS:
        a, b = _serval_logits(dense, prompt), _serval_logits(engine, prompt)
        assert (a - b).abs().max().item() < 2e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone(tiny_model_factory, tmp_path, family):
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(family, False)
    path = str(tmp_path / f"{family}-Q8_0.gguf")
    write_gguf_from_state_dict(
        path, reference.config.to_dict(), reference.state_dict(), GGMLQuantizationType.Q8_0
    )
    together = _greedy(_packed_engine(path), PROMPTS, max_tokens=10)
    alone = [_greedy(_packed_engine(path), [prompt], max_tokens=10)[0] for prompt in PROMPTS]
    assert together == alone
