"""The router features of DeepSeek-V3, GLM-4.5, MiniMax-M2 and DeepSeek-V2 (runner/moe.py, MoeArch): sigmoid
scores, a selection-only correction bias, group-limited top-k, renormalizing, routed_scaling_factor and
ungated shared experts, each block against transformers' own on the same random weights, through the
loader's name mapping; and a row's routing is its own whatever the batch."""

from __future__ import annotations

import pytest
import torch

from serval.runner.models.moe_arch import MoeArch
from serval.runner.moe import SparseMoe, expert_shards, expert_weight_target, split_fused_experts

HIDDEN = 64
_COMMON = {
    "hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 384, "moe_intermediate_size": 32, "intermediate_size": 32,
}  # fmt: skip


def _config(family: str):
    import transformers

    if family == "glm4_moe":  # 16 experts in 4 groups, the best 2 groups, 2 shared experts, scaled
        return "Glm4MoeForCausalLM", transformers.Glm4MoeConfig(
            **_COMMON, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
            routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0,
        )  # fmt: skip
    if family == "deepseek_v3":  # renormalizing off, to see the weights unnormalized
        return "DeepseekV3ForCausalLM", transformers.DeepseekV3Config(
            **_COMMON, n_routed_experts=16, num_experts_per_tok=3, n_group=8, topk_group=3, n_shared_experts=1,
            routed_scaling_factor=1.5, norm_topk_prob=False, first_k_dense_replace=0,
        )  # fmt: skip
    if family == "deepseek_v2":
        return "DeepseekV2ForCausalLM", transformers.DeepseekV2Config(
            **_COMMON, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
            routed_scaling_factor=1.5, topk_method="group_limited_greedy", norm_topk_prob=False,
        )  # fmt: skip
    if family == "minimax_m2":
        return "MiniMaxM2ForCausalLM", transformers.MiniMaxM2Config(
            **_COMMON, num_local_experts=8, num_experts_per_tok=2, head_dim=16
        )
    raise ValueError(family)


def _block(family: str):
    """transformers' sparse block of the family with random weights (a correction bias large enough to
    change choices), and its MoeArch."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    architecture, config = _config(family)
    blocks = {
        "glm4_moe": Glm4MoeMoE, "deepseek_v3": DeepseekV3MoE, "deepseek_v2": DeepseekV2Moe,
        "minimax_m2": MiniMaxM2SparseMoeBlock,
    }  # fmt: skip
    torch.manual_seed(0)
    block = blocks[family](config).eval()
    with torch.no_grad():
        for name, tensor in block.state_dict().items():
            scale = 0.3 if "e_score_correction_bias" in name else 0.5 if tensor.dim() == 2 else 0.15
            tensor.normal_(0.0, scale)
    return block, MoeArch.from_hf_config(architecture, config.to_dict())


def _load(ours: SparseMoe, block, moe: MoeArch) -> None:
    """The block's state dict into ours through the loader's own name mapping."""
    loaded = set()
    for name, tensor in block.state_dict().items():
        full = f"layers.0.mlp.{name}"
        for part, value in split_fused_experts(full, tensor) or [(full, tensor)]:
            target, shard = expert_weight_target(part, moe.num_experts)
            param = ours.get_parameter(target.removeprefix("layers.0.mlp."))
            with torch.no_grad():
                if shard is None:
                    param.copy_(value)
                else:
                    _, rows = expert_shards(target, HIDDEN, moe)
                    param[shard * rows : (shard + 1) * rows] = value
            loaded.add(f"{target}#{shard}")
    assert len(loaded) >= len(list(ours.parameters()))


FAMILIES = ["glm4_moe", "deepseek_v3", "deepseek_v2", "minimax_m2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_block_matches_transformers(family):
    block, moe = _block(family)
    ours = SparseMoe(HIDDEN, moe)
    _load(ours, block, moe)
    torch.manual_seed(1)
    x = torch.randn(40, HIDDEN)
    with torch.no_grad():
        theirs = block(x[None])
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs)[0]
    assert (ours(x) - theirs).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_matches_transformers_router(family):
    # The chosen experts (as sets: transformers' topk is unsorted) and their weights, row by row.
    block, moe = _block(family)
    ours = SparseMoe(HIDDEN, moe)
    _load(ours, block, moe)
    torch.manual_seed(2)
    x = torch.randn(64, HIDDEN)
    ids, weights = ours.route(x)
    with torch.no_grad():
        if family == "minimax_m2":
            _, their_weights, their_ids = block.gate(x, block.e_score_correction_bias)
        else:
            _, their_weights, their_ids = block.gate(x)
    order = their_ids.sort(dim=-1).indices
    mine = ids.sort(dim=-1).indices
    assert torch.equal(ids.gather(1, mine), their_ids.gather(1, order))
    torch.testing.assert_close(
        weights.gather(1, mine), their_weights.float().gather(1, order), rtol=1e-6, atol=1e-6
    )
    if moe.routed_scaling_factor != 1.0:
        assert not torch.allclose(weights.sum(-1), torch.ones(64)), "the scale shows"


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "minimax_m2"])
def test_the_correction_bias_chooses_but_does_not_weigh(family):
    block, moe = _block(family)
    ours = SparseMoe(HIDDEN, moe)
    _load(ours, block, moe)
    torch.manual_seed(3)
    x = torch.randn(64, HIDDEN)
    ids, weights = ours.route(x)
    with torch.no_grad():
        bias = ours.score_correction.bias.clone()
        ours.score_correction.bias.zero_()
        unbiased_ids, _ = ours.route(x)
        ours.score_correction.bias.copy_(bias)
    assert not torch.equal(ids, unbiased_ids), "the bias changes some rows' experts"
    scores = torch.sigmoid(x @ ours.gate.weight.t())
    expected = scores.gather(1, ids)
    if moe.renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected * moe.routed_scaling_factor)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "deepseek_v2"])
def test_groups_limit_the_choice(family):
    # Every row's experts lie in at most topk_groups groups, and without groups some rows would choose others.
    block, moe = _block(family)
    ours = SparseMoe(HIDDEN, moe)
    _load(ours, block, moe)
    torch.manual_seed(4)
    x = torch.randn(64, HIDDEN)
    ids, _ = ours.route(x)
    group_size = moe.num_experts // moe.num_groups
    assert all(len(set((row // group_size).tolist())) <= moe.topk_groups for row in ids)
    ours.num_groups = 1
    ungrouped, _ = ours.route(x)
    assert not torch.equal(ids, ungrouped)


def test_ties_between_groups_go_to_the_lower_group():
    _, moe = _block("glm4_moe")
    ours = SparseMoe(HIDDEN, moe)
    with torch.no_grad():
        ours.gate.weight.zero_()  # every score 0.5: every group ties, every expert too
    ids, weights = ours.route(torch.randn(5, HIDDEN))
    assert (ids == torch.arange(moe.top_k)).all()  # groups 0 and 1, experts by id
    torch.testing.assert_close(weights, torch.full_like(weights, moe.routed_scaling_factor / moe.top_k))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_routing_is_its_own_whatever_the_batch(family):
    # With the native router (kernels.router_logits: a row's logits are the same bits in any batch) the
    # scoring, bias, groups and top-k after it are per row too, so a row's experts and weights are its own.
    from serval.runner.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no native kernels on this machine")
    block, moe = _block(family)
    ours = SparseMoe(HIDDEN, moe)
    _load(ours, block, moe)
    ours.use_kernels(kernels, int8_batch_activations=False)
    assert ours.router_kernel is not None
    torch.manual_seed(5)
    x = torch.randn(37, HIDDEN)
    ids, weights = ours.route(x)
    for rows in (slice(0, 1), slice(3, 4), slice(0, 5), slice(17, 37)):
        alone_ids, alone_weights = ours.route(x[rows])
        assert torch.equal(alone_ids, ids[rows]) and torch.equal(alone_weights, weights[rows])


def test_the_correction_bias_stays_fp32_in_a_bf16_model():
    _, moe = _block("glm4_moe")
    ours = SparseMoe(HIDDEN, moe).to(torch.bfloat16)
    assert ours.score_correction.bias.dtype == torch.float32 and ours.gate.weight.dtype == torch.bfloat16


def test_first_k_dense_replace_and_defaults():
    _, config = _config("glm4_moe")
    cfg = {**config.to_dict(), "num_hidden_layers": 4, "first_k_dense_replace": 2}
    moe = MoeArch.from_hf_config("Glm4MoeForCausalLM", cfg)
    assert moe.dense_layers == frozenset({0, 1}) and moe.shared_experts_intermediate_size == 2 * 32
    assert not moe.has_plain_routing
    # DeepSeek-V3's released config spells the expert count n_routed_experts; missing keys take its defaults.
    released = {
        "num_hidden_layers": 61,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
    }
    v3 = MoeArch.from_hf_config("DeepseekV3ForCausalLM", released)
    assert (v3.num_groups, v3.topk_groups, v3.routed_scaling_factor) == (8, 4, 2.5)
    assert v3.dense_layers == frozenset({0, 1, 2}) and v3.renormalize and v3.scoring == "sigmoid"
    with pytest.raises(ValueError, match="topk_group"):
        MoeArch.from_hf_config(
            "DeepseekV3ForCausalLM", {**released, "n_group": 64, "topk_group": 1, "num_experts_per_tok": 8}
        )
