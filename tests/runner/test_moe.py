"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss) against transformers, the native expert
kernel (kernels/moe.cpp) against the PyTorch expert path on the same packed weights, and the DecodeStack
against the layers."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner import placement
from serval.runner.moe import SparseMoe
from tests.runner.test_models import PROMPTS, _engine, _greedy, _serval_logits, assert_greedy_matches

MOE_ARCHITECTURES = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"]


def _sparse_layers(engine: Engine) -> list[SparseMoe]:
    return [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoe)]


def _packed_engine(path: str, batch_activations: str = "int8") -> Engine:
    # dtype auto: the packed kernels from the file's blocks (fp32 compute on a CPU without bf16)
    model = ModelConfig(model=path, batch_activations=batch_activations)
    return Engine(EngineConfig(model=model, cache=CacheConfig(num_blocks=64)))


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_logits_and_greedy_match_transformers(tiny_model_factory, architecture):
    directory, reference = tiny_model_factory(architecture, False)
    engine = _engine(directory)
    assert _sparse_layers(engine), "the model has sparse layers"
    for prompt in PROMPTS:
        for end in (1, len(prompt)):
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt[:end]])).logits[0, -1]
            assert (_serval_logits(engine, prompt[:end]) - theirs).abs().max().item() < 1e-3
    assert_greedy_matches(engine, reference, PROMPTS, max_tokens=10)


def test_qwen2_moe_keeps_its_dense_layer_and_shared_expert(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen2_moe", False)
    layers = _engine(directory).runner.model.layers
    assert not isinstance(layers[0].mlp, SparseMoe)  # mlp_only_layers=[0]
    assert isinstance(layers[1].mlp, SparseMoe) and layers[1].mlp.shared_expert is not None


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_gguf_matches_transformers(tiny_model_factory, tmp_path, architecture):
    # llama.cpp's layout: 3-D ffn_{gate,up,down}_exps, the router as ffn_gate_inp, expert_* metadata.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(architecture, False)
    path = str(tmp_path / f"{architecture}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict())
    engine = _engine(path)
    assert engine.runner.arch.architecture == reference.config.architectures[0]
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        assert (_serval_logits(engine, prompt) - theirs).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.MXFP4,
    ],
    ids=lambda t: t.name,
)
@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_packed_experts_run_natively_and_agree_with_the_dense_path(
    tiny_model_factory, tmp_path, architecture, qtype, monkeypatch
):
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory(architecture, False)
    path = str(tmp_path / f"{architecture}-{qtype.name}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict(), qtype)
    dense = Engine(
        EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(num_blocks=64))
    )
    packed = _packed_engine(path)
    if packed.runner.kernel_variant == "none":
        pytest.skip("no native kernels on this machine")
    sparse = _sparse_layers(packed)
    assert sparse and all(m.native_kernel is not None for m in sparse), (
        "the experts run in kernels.moe_experts"
    )
    # The stacks were packed from the file's blocks, never dense: their dense weights are placeholders.
    assert all(m.experts.gate_proj.weight.stride() == (0, 0) for m in sparse)
    for prompt in PROMPTS:
        a, b = _serval_logits(dense, prompt), _serval_logits(packed, prompt)
        assert (a - b).abs().max().item() < 2e-2
        assert a.argmax() == b.argmax()
    # With exact products (x rounded to int16 per block, 2^-15 of its largest value) in fp32 the answers are
    # the dense path's; int8 x (above, the default) rounds to 2^-7, within the bound but not every near-tie.
    # fp32 compute is what `auto` gives on a CPU without native bf16; on one with it (Zen 4, Xeon) `auto` is
    # bf16, whose residual rounding (2^-8) moves near-ties too, so the test asks for the fp32 kernels there.
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda: False)
    exact = _packed_engine(path, batch_activations="float32")
    assert _greedy(exact, PROMPTS, max_tokens=8) == _greedy(dense, PROMPTS, max_tokens=8)


def _q4_0_router_f32(name: str) -> GGMLQuantizationType:
    # The routers F32 as llama.cpp's converter keeps them (a quantized router takes the layer-by-layer path).
    return GGMLQuantizationType.F32 if ".ffn_gate_inp." in name else GGMLQuantizationType.Q4_0


@pytest.mark.parametrize("batch_activations", ["int8", "float32"])
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_decode_stack_computes_what_the_sparse_layers_compute(
    tiny_model_factory, tmp_path, architecture, batch_activations
):
    # The native DecodeStack runs the sparse layers too (the router, moe_experts; gpt-oss's sinks, window
    # and output bias): one decode step through it and through the Python layers, bit for bit.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict
    from tests.runner.test_quantized import _decode_logits_both_ways

    _, reference = tiny_model_factory(architecture, False)
    path = str(tmp_path / f"{architecture}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict(), _q4_0_router_f32)
    engine = _packed_engine(path, batch_activations)
    if engine.runner.kernel_variant == "none":
        pytest.skip("no native kernels on this machine")
    assert engine.runner.model.decode_stack is not None
    stacked, layered = _decode_logits_both_ways(engine, PROMPTS)
    assert torch.equal(stacked, layered)


def test_a_shared_expert_keeps_the_layer_by_layer_decode(tiny_model_factory, tmp_path):
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory("qwen2_moe", False)
    path = str(tmp_path / "qwen2_moe.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict(), _q4_0_router_f32)
    engine = _packed_engine(path)
    if engine.runner.kernel_variant == "none":
        pytest.skip("no native kernels on this machine")
    assert engine.runner.model.decode_stack is None  # the stack has no shared expert


# (batch activations, bound relative to the largest output): x rounded to int16 per block (2^-15 of its
# largest value), or to int8 (2^-7), which only 4-bit layouts (Q4_0, Q4_1, Q4_K, MXFP4) take.
ROUNDINGS = [("float32", 2e-3), ("int8", 3e-2)]


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4], ids=lambda t: t.name
)
def test_native_experts_equal_the_pytorch_path_on_the_same_packed_weights(
    tiny_model_factory, tmp_path, qtype
):
    # Both paths compute from the file's exact weights; only x's rounding (int8/int16 per block) differs.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory("qwen3_moe", False)
    path = str(tmp_path / f"{qtype.name}.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict(), qtype)
    for batch_activations, bound in ROUNDINGS:
        engine = _packed_engine(path, batch_activations)
        if engine.runner.kernel_variant == "none":
            pytest.skip("no native kernels on this machine")
        moe = _sparse_layers(engine)[0]
        torch.manual_seed(0)
        for num_tokens in (1, 3, 17, 64):  # decode rows, few rows per expert, many
            x = torch.randn(num_tokens, reference.config.hidden_size)
            ids, weights = moe.route(x)
            native = moe(x)
            exact = moe.experts_reference(x, ids, weights)
            assert native.shape == exact.shape and native.dtype == torch.float32
            error = (native - exact).abs().max().item()
            assert error < bound * exact.abs().max().item(), (batch_activations, num_tokens)


def test_batched_equals_alone(tiny_model_factory, tmp_path):
    # A sequence's greedy tokens do not depend on the other sequences of its steps (whose tokens choose
    # other experts): the routing and each token's weighted sum are per token.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory("qwen3_moe", False)
    path = str(tmp_path / "f32.gguf")
    write_gguf_from_state_dict(
        path, reference.config.to_dict(), reference.state_dict(), GGMLQuantizationType.Q8_0
    )
    together = _greedy(_packed_engine(path), PROMPTS, max_tokens=10)
    alone = [_greedy(_packed_engine(path), [prompt], max_tokens=10)[0] for prompt in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("hidden", [2048, 72])  # a real width, and one with a tail past the vector width
def test_router_logits_are_each_rows_own_whatever_the_batch(hidden):
    # kernels.router_logits splits over experts and computes up to four tokens beside each other: a row's
    # scores are the same bits alone and in any batch, and they are x @ w.T.
    from serval.runner.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no native kernels on this machine")
    torch.manual_seed(0)
    w = torch.randn(128, hidden) / hidden**0.5
    x = torch.randn(37, hidden)
    batched = kernels.router_logits(x, w)
    torch.testing.assert_close(batched, x @ w.T, rtol=1e-5, atol=1e-5)
    for num_tokens in (1, 3, 4, 5, 16, 17, 37):
        assert torch.equal(kernels.router_logits(x[:num_tokens], w), batched[:num_tokens])
    for row in (0, 5, 36):
        assert torch.equal(kernels.router_logits(x[row : row + 1], w), batched[row : row + 1])


def test_routing_ties_go_to_the_lower_expert_whatever_the_batch(tmp_path):
    # torch.topk (transformers' router) orders tied values arbitrarily, even differently between rows; serval
    # breaks ties by expert id, so a token's experts are a function of its own scores alone.
    from tests.fixtures.tiny_models import write_tiny_model

    reference = write_tiny_model(str(tmp_path), "mixtral")  # its own copy: the router is edited below
    engine = _engine(str(tmp_path))
    ours = _sparse_layers(engine)[0]
    theirs = reference.model.layers[0].mlp.gate
    # Experts 2, 5 and 6 get the same router row: every token scores them equally.
    with torch.no_grad():
        for router in (ours.gate.weight, theirs.weight):
            router[2] *= 5.0  # the tied three are the top choices wherever their score is positive
            router[5] = router[2]
            router[6] = router[2]
    torch.manual_seed(0)
    x = torch.randn(32, reference.config.hidden_size)
    ids, weights = ours.route(x)
    _, their_weights, their_ids = theirs(x)
    assert torch.allclose(weights, their_weights.float(), atol=1e-6)  # the same scores, whichever expert
    top_is_tied = torch.isin(ids[:, 0], torch.tensor([2, 5, 6]))
    assert top_is_tied.any() and (~top_is_tied).any(), "some rows tie, some do not"
    assert (ids[top_is_tied] == torch.tensor([2, 5])).all()  # the lower ids of the tied three
    untied = ~torch.isin(their_ids, torch.tensor([2, 5, 6])).any(dim=1)
    assert torch.equal(ids[untied], their_ids[untied])
    for row in range(x.shape[0]):  # alone, each row routes as it did in the batch
        alone_ids, alone_weights = ours.route(x[row : row + 1])
        assert torch.equal(alone_ids[0], ids[row]) and torch.equal(alone_weights[0], weights[row])


def _gpt_oss_mlp(seed: int = 0):
    """transformers' gpt-oss MoE block (router with bias, 8 experts with biases, top-2) and its config dict."""
    import transformers

    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
    )  # fmt: skip
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(seed)
    block = GptOssMLP(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3 if param.dim() < 3 else 0.15)  # wide enough that the clamps engage
    return block, config.to_dict()


def _load_block(ours: SparseMoe, block) -> None:
    # The loader's own name mapping: gpt-oss's fused, transposed, interleaved experts into per-expert shards.
    from serval.runner.moe import expert_shards, expert_weight_target, split_fused_experts

    moe = ours.experts
    for name, tensor in block.state_dict().items():
        full = f"layers.0.mlp.{name}"
        for part, value in split_fused_experts(full, tensor, transposed_interleaved=True) or [(full, tensor)]:
            target, shard = expert_weight_target(part, moe.num_experts)
            param = ours.get_parameter(target.removeprefix("layers.0.mlp."))
            with torch.no_grad():
                if shard is None:
                    param.copy_(value)
                else:
                    _, rows = expert_shards(
                        target.replace(".bias", ".weight"), moe.hidden, _moe_arch_of(ours)
                    )
                    param[shard * rows : (shard + 1) * rows] = value


def _moe_arch_of(ours: SparseMoe):
    from serval.runner.models.arch import MoeArch

    e = ours.experts
    return MoeArch(e.num_experts, ours.top_k, e.inter, True, frozenset())


def test_gpt_oss_experts_match_transformers():
    # Router bias, top-k of the logits then a softmax over them, expert biases, the clamped SwiGLU (alpha
    # 1.702, limit 7, up + 1), gate and up interleaved in the checkpoint.
    from serval.runner.models.arch import MoeArch

    block, config = _gpt_oss_mlp()
    arch = MoeArch.from_hf_config("GptOssForCausalLM", config)
    assert arch.has_biases and arch.activation == "clamped_swiglu" and arch.renormalize
    ours = SparseMoe(64, arch)
    _load_block(ours, block)
    torch.manual_seed(1)
    x = torch.randn(24, 64) * 3
    with torch.no_grad():
        theirs, _ = block(x[None])
        gate_up = x @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
    assert (gate_up[:, 0::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any(), "the clamps are exercised"
    assert (ours(x) - theirs[0]).abs().max().item() < 1e-4


# gpt-oss's GGUF experts are MXFP4 (ggml-org's files); Q8_0 as the other packed formats.
@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4], ids=lambda t: t.name
)
def test_gpt_oss_experts_natively_over_packed_stacks(qtype):
    from serval.runner.kernels import load_cpu_kernels
    from serval.runner.models.arch import MoeArch
    from serval.runner.quantization import pack_block_codes
    from tests.fixtures.quants import quantize

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no native kernels on this machine")
    from serval.runner.loader.dequant import block_codes

    block, config = _gpt_oss_mlp()
    ours = SparseMoe(64, MoeArch.from_hf_config("GptOssForCausalLM", config))
    _load_block(ours, block)
    for stack in (ours.experts.gate_proj, ours.experts.up_proj, ours.experts.down_proj):
        raw = quantize(stack.weight.detach().numpy(), qtype)
        stack.packed = pack_block_codes(block_codes(raw, qtype, tuple(stack.weight.shape)))
    torch.manual_seed(2)
    x = torch.randn(9, 64) * 3
    ids, weights = ours.route(x)
    exact = ours.experts_reference(x, ids, weights)  # the packed stacks' exact weights, in PyTorch
    ours.use_kernels(kernels, int8_batch_activations=False)
    assert ours.native_kernel is not None
    native = ours(x)
    assert (native - exact).abs().max().item() < 1e-3 * exact.abs().max().item()
