"""GLM (GlmForCausalLM), ChatGLM3 (ChatGLMModel), GLM-4 (Glm4ForCausalLM), GLM-4.5 (Glm4MoeForCausalLM) and MiniMax-M2 against transformers on tiny random
checkpoints, as safetensors and as llama.cpp's GGUF; the native expert kernel against the PyTorch path on the
same packed weights; a sequence's greedy tokens alone and beside others."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner import placement
from serval.runner.moe import SparseMoe
from tests.runner.test_models import PROMPTS, _engine, _greedy, _serval_logits, assert_greedy_matches

FAMILIES = ["glm", "glm4", "glm4_moe", "minimax_m2"]
MOE_FAMILIES = ["glm4_moe", "minimax_m2"]
GGUF_FAMILIES = FAMILIES  # llama.cpp's glm4, glm4moe, minimax-m2, and chatglm for transformers' GLM


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


@pytest.mark.parametrize("family", GGUF_FAMILIES)
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
    tiny_model_factory, tmp_path, family, qtype, monkeypatch
):
    # fp32 compute (`auto` on a CPU without native bf16): both paths then differ only in x's rounding to
    # int16 per block inside the kernel (2^-15 of its largest value).
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda: False)

    _, reference = tiny_model_factory(family, False)
    path = str(tmp_path / f"{family}-{qtype.name}.gguf")

    def router_f32(name: str) -> GGMLQuantizationType:  # as llama.cpp's converter keeps the routers
        return GGMLQuantizationType.F32 if ".ffn_gate_inp." in name else qtype

    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict(), router_f32)
    engine = _packed_engine(path)
    if engine.runner.kernel_variant == "none":
        pytest.skip("no native kernels on this machine")
    sparse = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoe)]
    assert sparse and all(m.native_kernel is not None and m.router_kernel is not None for m in sparse)
    assert engine.runner.model.decode_stack is None  # partial RoPE, sigmoid routers: layer by layer
    torch.manual_seed(0)
    for moe in sparse:
        for num_tokens in (1, 5, 33):
            x = torch.randn(num_tokens, reference.config.hidden_size)
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


@pytest.mark.parametrize("family", GGUF_FAMILIES)
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


def test_gguf_names_of_the_families():
    from serval.runner.loader.gguf_names import hf_tensor_name

    layer = "model.layers.3"
    assert hf_tensor_name("blk.3.ffn_up.weight", "glm4") == f"{layer}.mlp.gate_up_proj.weight"
    assert hf_tensor_name("blk.3.ffn_up.weight", "glm4moe") == f"{layer}.mlp.up_proj.weight"
    assert (
        hf_tensor_name("blk.3.post_attention_norm.weight", "glm4")
        == f"{layer}.post_self_attn_layernorm.weight"
    )
    assert hf_tensor_name("blk.3.post_ffw_norm.weight", "glm4") == f"{layer}.post_mlp_layernorm.weight"
    assert (
        hf_tensor_name("blk.3.post_attention_norm.weight", "glm4moe")
        == f"{layer}.post_attention_layernorm.weight"
    )
    assert (
        hf_tensor_name("blk.3.ffn_gate_shexp.weight", "glm4moe")
        == f"{layer}.mlp.shared_experts.gate_proj.weight"
    )
    assert (
        hf_tensor_name("blk.3.ffn_gate_shexp.weight", "qwen2moe")
        == f"{layer}.mlp.shared_expert.gate_proj.weight"
    )
    assert (
        hf_tensor_name("blk.3.exp_probs_b.bias", "minimax-m2") == f"{layer}.mlp.gate.e_score_correction_bias"
    )
    assert hf_tensor_name("blk.46.nextn.eh_proj.weight", "glm4moe") == "model.layers.46.eh_proj.weight"


@pytest.mark.parametrize("rope_ratio", [1.0, 50.0])  # ChatGLM3-6B's, and a 32k variant's larger base
def test_chatglm3_directory_matches_transformers_glm(tmp_path, rope_ratio):
    # THUDM's remote-code layout (tests/fixtures/tiny_chatglm.py); the oracle is transformers' GlmForCausalLM
    # on the same weights, which computes ChatGLM3's block (that module's docstring says why).
    from tests.fixtures.tiny_chatglm import write_tiny_chatglm

    reference = write_tiny_chatglm(str(tmp_path), rope_ratio)
    engine = _engine(str(tmp_path))
    arch = engine.runner.arch
    assert (arch.architecture, arch.num_kv_heads, arch.rope_dim, arch.rope_interleaved) == (
        "ChatGLMModel",
        2,
        16,
        True,
    )
    assert arch.rope_theta == 10000.0 * rope_ratio
    for prompt in PROMPTS:
        for end in (1, len(prompt)):
            assert _max_error(engine, reference, prompt[:end]) < 1e-3
    assert_greedy_matches(engine, reference, PROMPTS, max_tokens=10)


def test_the_first_chatglm_is_refused():
    from serval.runner.models.arch import ArchConfig

    v1 = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 4096, "num_layers": 28,
          "num_attention_heads": 32, "vocab_size": 130528, "inner_hidden_size": 16384, "position_encoding_2d": True}  # fmt: skip
    with pytest.raises(ValueError, match="ChatGLM-6B"):
        ArchConfig.from_hf_config(v1)


def test_chatglm3_gguf_with_fused_qkv_matches_transformers_glm(tmp_path):
    # llama.cpp's ChatGLM3 files keep query_key_value fused (blk.N.attn_qkv): served as ChatGLMModel.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict
    from tests.fixtures.tiny_chatglm import write_tiny_chatglm

    reference = write_tiny_chatglm(str(tmp_path / "hf"), rope_ratio=50.0)
    state = dict(reference.state_dict())
    for i in range(reference.config.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            state[f"{attn}qkv_proj.{kind}"] = torch.cat([state.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"])
    path = str(tmp_path / "chatglm3.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), state)
    engine = _engine(path)
    assert engine.runner.arch.architecture == "ChatGLMModel" and engine.runner.arch.attention_bias
    for prompt in PROMPTS:
        assert _max_error(engine, reference, prompt) < 1e-3
    assert_greedy_matches(engine, reference, PROMPTS[:2], max_tokens=8)


def test_glm4_moe_gguf_passes_over_its_multi_token_prediction_layer(tiny_model_factory, tmp_path):
    # llama.cpp's GLM-4.5 files count the MTP layer in block_count (nextn_predict_layers) and hold a whole
    # decoder layer for it plus blk.N.nextn.* tensors: dense or packed, the model loads past them.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory("glm4_moe", False)
    state = dict(reference.state_dict())
    last = reference.config.num_hidden_layers - 1
    mtp = reference.config.num_hidden_layers
    for name, tensor in list(state.items()):
        if name.startswith(f"model.layers.{last}."):
            state[name.replace(f"layers.{last}.", f"layers.{mtp}.")] = tensor.clone()
    hidden = reference.config.hidden_size
    state |= {
        f"model.layers.{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
        f"model.layers.{mtp}.enorm.weight": torch.ones(hidden),
        f"model.layers.{mtp}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{mtp}.shared_head.norm.weight": torch.ones(hidden),
    }
    f32, q8 = str(tmp_path / "mtp-f32.gguf"), str(tmp_path / "mtp-q8.gguf")
    write_gguf_from_state_dict(f32, reference.config.to_dict(), state)
    write_gguf_from_state_dict(
        q8, reference.config.to_dict(), state,
        lambda name: GGMLQuantizationType.F32 if ".ffn_gate_inp." in name else GGMLQuantizationType.Q8_0,
    )  # fmt: skip
    dense = _engine(f32)
    assert dense.runner.arch.num_layers == reference.config.num_hidden_layers
    for prompt in PROMPTS:
        assert _max_error(dense, reference, prompt) < 1e-3
    packed = _packed_engine(q8)
    for prompt in PROMPTS:
        assert (_serval_logits(packed, prompt) - _serval_logits(dense, prompt)).abs().max().item() < 3e-2
