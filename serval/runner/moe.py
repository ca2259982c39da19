"""The sparse mixture-of-experts MLP: a router, top-k experts per token, and (Qwen2-MoE) a shared expert.

Each projection of all the layer's experts is one stacked matrix, a `Linear` of num_experts x its rows
(expert e's gate rows are e*I .. (e+1)*I - 1), so the loader packs it like any matrix: a GGUF file's 3-D
`ffn_*_exps` tensor is exactly that matrix's blocks, packed at the file's size with no dense copy, and a
checkpoint's per-expert tensors are its row shards (gpt-oss: with biases, the clamped SwiGLU). With the
native kernels the experts run in one call
(kernels/moe.cpp: tokens grouped by expert, every (expert, block of rows) in parallel); the PyTorch path
below is the reference it is tested against, and serves dense checkpoints.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from serval.runner.layers import GatedMLP, Linear, takes_dense_kernel
from serval.runner.models.arch import MoeArch
from serval.runner.quantization import PackedWeight

# The per-expert checkpoint names of one projection, Qwen-MoE's (`mlp.experts.E.gate_proj`) and Mixtral's
# (`block_sparse_moe.experts.E.w1`: w1 gate, w3 up, w2 down) -> our stacked matrix.
_EXPERT_TENSOR = re.compile(
    r"(?P<layer>layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)"
)
_EXPERT_PARTS = {
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}
# transformers 5's in-memory layout (what a state dict holds): all experts in 3-D tensors, gate and up fused;
# gpt-oss's checkpoints hold them so too, transposed ((E, in, out)), gate and up interleaved, with biases.
_FUSED_EXPERTS = re.compile(
    r"(?P<layer>layers\.\d+)\.mlp\.experts\.(?P<part>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # kernels.moe_experts' activation codes


class ExpertStacks(nn.Module):
    """The routed experts' three projections, each stacked over the experts: gate_proj and up_proj
    (num_experts * inter, hidden), down_proj (num_experts * hidden, inter)."""

    def __init__(self, hidden_size: int, moe: MoeArch):
        super().__init__()
        self.num_experts, self.inter, self.hidden = moe.num_experts, moe.expert_intermediate_size, hidden_size
        bias = moe.has_biases
        self.gate_proj = Linear(hidden_size, self.num_experts * self.inter, bias=bias)
        self.up_proj = Linear(hidden_size, self.num_experts * self.inter, bias=bias)
        self.down_proj = Linear(self.inter, self.num_experts * hidden_size, bias=bias)

    def biases(self) -> list[torch.Tensor]:
        """The three stacks' fp32 biases for kernels.moe_experts (empty tensors without)."""
        return [
            torch.empty(0) if p.bias is None else p.bias.detach().float().contiguous()
            for p in (self.gate_proj, self.up_proj, self.down_proj)
        ]

    def expert_bias(self, projection: Linear, expert: int) -> torch.Tensor | float:
        rows = projection.out_features // self.num_experts
        return (
            0.0 if projection.bias is None else projection.bias[expert * rows : (expert + 1) * rows].float()
        )

    def expert_weight(self, projection: Linear, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's (rows, K) matrix of a stacked projection: a view of the dense weight, or its rows
        dequantized exactly from the packed form when the dense copy was released."""
        rows = projection.out_features // self.num_experts
        packed = projection.packed
        if packed is None:
            return projection.weight[expert * rows : (expert + 1) * rows]
        return packed.rows(torch.arange(expert * rows, (expert + 1) * rows)).to(dtype)

    def packed_parts(self) -> list[list[torch.Tensor]] | None:
        """The three stacks' packed tensors for kernels.moe_experts, or None unless all three are packed
        block matrices (one layout each)."""
        stacks = [p.packed for p in (self.gate_proj, self.up_proj, self.down_proj)]
        if not all(isinstance(s, PackedWeight) and s.bits != 16 for s in stacks):
            return None
        return [[s.codes, s.scales, s.offsets, s.super_scales] for s in stacks]


class ScoreCorrection(nn.Module):
    """The per-expert bias added to the router's scores to choose experts (e_score_correction_bias), kept
    in fp32 whatever the model's dtype, as transformers keeps it: bf16 would move near-ties between experts."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        # NOTE: model.to(dtype) runs before the checkpoint is copied in; keeping the parameter fp32 here means
        # the loaded values are never rounded.
        super()._apply(fn, recurse)
        if self.bias.dtype != torch.float32:
            self.bias = nn.Parameter(self.bias.float(), requires_grad=False)
        return self


class SparseMoe(nn.Module):
    """Router, routed experts and optional shared expert(s) of one sparse layer (transformers'
    Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3MoE, Glm4MoeMoE,
    MiniMaxM2SparseMoeBlock compute the same). Routing runs in PyTorch row by row (each row's experts are a
    function of its own scores); the experts then run in kernels.moe_experts or experts_reference."""

    def __init__(self, hidden_size: int, moe: MoeArch):
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.activation, self.alpha, self.limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        self.gate = Linear(hidden_size, moe.num_experts, bias=moe.has_biases)  # the router
        self.experts = ExpertStacks(hidden_size, moe)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.shared_experts = (
            GatedMLP(hidden_size, moe.shared_experts_intermediate_size)
            if moe.shared_experts_intermediate_size
            else None
        )
        self.score_correction = ScoreCorrection(moe.num_experts) if moe.has_score_correction else None
        self.scoring, self.routed_scaling_factor = moe.scoring, moe.routed_scaling_factor
        self.num_groups, self.topk_groups = moe.num_groups, moe.topk_groups
        self.group_scoring = moe.group_scoring
        self.has_plain_routing = moe.has_plain_routing
        # kernels.moe_experts and its packed stacks, set by use_kernels; None: the PyTorch path
        self.native_kernel = None
        self.native_parts: list[list[torch.Tensor]] | None = None
        self.native_biases: list[torch.Tensor] = []
        self.int8_batch_activations = False
        self.expert_dense_kernel = None  # kernels.dense_linear for dense experts, set by use_kernels
        # kernels.router_logits and the router's fp32 weight (1 MB for 128 experts of 2048), set by use_kernels
        self.router_kernel = None
        self.router_weight: torch.Tensor | None = None

    def use_kernels(self, kernels, int8_batch_activations: bool, deterministic: bool = False) -> None:
        parts = self.experts.packed_parts()
        self.native_kernel = None if parts is None else kernels.moe_experts
        # Dense experts (a checkpoint's fp32/bf16/f16 stacks) run in experts_reference, each expert's rows
        # through the batch-invariant dense matmul where layers.takes_dense_kernel says so: how many tokens
        # chose an expert then never changes a token's bits.
        dense = self.experts.gate_proj
        uses_dense = (
            parts is None and dense.packed is None and takes_dense_kernel(dense.weight, deterministic)
        )
        self.expert_dense_kernel = kernels.dense_linear if uses_dense else None
        self.native_parts = parts
        self.native_biases = self.experts.biases()
        self.int8_batch_activations = int8_batch_activations
        router = self.gate
        if router.packed is None:  # a quantized router keeps its packed kernel (rare: files keep it F32)
            self.router_kernel = kernels.router_logits
            self.router_weight = router.weight.detach().float().contiguous()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: (num_tokens, top_k) int64 ids and fp32 weights, in the
        order of the choice (the scores, plus the correction bias where there is one: then not always the
        heaviest first). Ties go to the lower expert id (a stable sort); with the native router the scores
        are the same bits whatever the batch, so the choice is too."""
        if self.router_kernel is not None:
            logits = self.router_kernel(x, self.router_weight)
            if self.gate.bias is not None:
                logits = logits + self.gate.bias.float()
        else:
            logits = self.gate(x).float()
        # (num_tokens, num_experts)
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores if self.score_correction is None else scores + self.score_correction.bias.float()
        if self.num_groups > 1:
            choice = self._within_best_groups(choice)
        ids = choice.sort(dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = scores.gather(1, ids)  # the unbiased scores: the bias only chooses
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return ids, weights

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The choice scores with every expert outside each row's best topk_groups groups at -inf (ties
        between groups go to the lower group, as between experts)."""
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.num_groups, num_experts // self.num_groups)
        if self.group_scoring == "top2_sum":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (num_tokens, num_groups)
        else:
            group_scores = grouped.max(dim=-1).values
        best = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, : self.topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # (num_tokens, hidden) -> fp32
        ids, weights = self.route(x)
        if self.native_kernel is not None:
            e = self.experts
            out = self.native_kernel(
                x, ids, weights, *self.native_parts, *self.native_biases, e.num_experts, e.inter, e.hidden,
                ACTIVATIONS[self.activation], self.alpha, self.limit, self.int8_batch_activations,
            )  # fmt: skip
        else:
            out = self.experts_reference(x, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x).float()
            out = out + torch.sigmoid(self.shared_expert_gate(x).float()) * shared
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out

    def experts_reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts in PyTorch, one expert at a time over the tokens that chose it."""
        stacks = self.experts
        out = torch.zeros(x.shape[0], stacks.hidden, dtype=torch.float32)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (num_tokens * top_k,) grouped by expert
        counts = torch.bincount(flat, minlength=stacks.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // self.top_k
            xe = x[tokens]
            gate = self._expert_matmul(xe, stacks.expert_weight(stacks.gate_proj, expert, x.dtype))
            up = self._expert_matmul(xe, stacks.expert_weight(stacks.up_proj, expert, x.dtype))
            gate = gate.float() + stacks.expert_bias(stacks.gate_proj, expert)
            up = up.float() + stacks.expert_bias(stacks.up_proj, expert)
            h = self.activate(gate, up).to(x.dtype)
            y = self._expert_matmul(h, stacks.expert_weight(stacks.down_proj, expert, x.dtype))
            y = y.float() + stacks.expert_bias(stacks.down_proj, expert)
            out.index_add_(0, tokens, y * weights.flatten()[slots, None])
        return out

    def _expert_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.expert_dense_kernel is not None:
            return self.expert_dense_kernel(x, weight)
        return x @ weight.t()

    def activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(self.alpha * gate) * (up + 1)


def expert_weight_target(name: str, num_experts: int) -> tuple[str, int | None] | None:
    """Our parameter and shard for a checkpoint tensor of a sparse layer's experts (name without
    `model.`), or None if it is not one: per-expert tensors are row shards of the stacked matrices."""
    match = _EXPERT_TENSOR.fullmatch(name)
    if match is not None and match["part"] in _EXPERT_PARTS:
        expert = int(match["expert"])
        if expert >= num_experts:
            raise ValueError(f"weight {name!r} names expert {expert} of a model with {num_experts}")
        return f"{match['layer']}.mlp.experts.{_EXPERT_PARTS[match['part']]}.{match['kind']}", expert
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    if name.endswith((".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")):
        return name[: name.index(".mlp.")] + ".mlp.score_correction.bias", None  # GLM/DeepSeek's, MiniMax's
    for hf, ours in (("shared_experts.gate_proj.", 0), ("shared_experts.up_proj.", 1)):  # DeepSeek's
        if f".mlp.{hf}" in name:
            return name.replace(hf, "shared_experts.gate_up_proj."), ours
    if ".mlp.shared_experts." in name:
        return name, None
    for hf, ours in (("shared_expert.gate_proj.", 0), ("shared_expert.up_proj.", 1)):  # Qwen2-MoE's
        if f".mlp.{hf}" in name:
            return name.replace(hf, "shared_expert.gate_up_proj."), ours
    if name.endswith((".mlp.gate.weight", ".mlp.gate.bias")) or ".mlp.shared_expert" in name:
        return name, None
    return None


def split_fused_experts(
    name: str, tensor: torch.Tensor, transposed_interleaved: bool = False
) -> list[tuple[str, torch.Tensor]] | None:
    """transformers 5's 3-D expert tensors (a state dict's `mlp.experts.gate_up_proj` (E, 2I, H) and
    `down_proj` (E, H, I)) as the per-expert tensors a saved checkpoint holds; None for any other tensor.
    transposed_interleaved: gpt-oss's layout, gate_up_proj (E, H, 2I) with gate and up in alternate
    columns, down_proj (E, I, H), and their biases (E, 2I) and (E, H)."""
    match = _FUSED_EXPERTS.search(name)
    if match is None or tensor.dim() != (2 if match["bias"] else 3):
        return None
    prefix = name[: match.start()] + match["layer"] + ".mlp.experts"
    kind = "bias" if match["bias"] else "weight"
    if transposed_interleaved and not match["bias"]:
        tensor = tensor.transpose(1, 2)  # (E, out, in), as the other families store them
    if match["part"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.{kind}", t) for e, t in enumerate(tensor)]
    if transposed_interleaved:
        gates, ups = tensor[:, 0::2], tensor[:, 1::2]
    else:
        gates, ups = tensor.split(tensor.shape[1] // 2, dim=1)
    split = []
    for e in range(tensor.shape[0]):
        split += [(f"{prefix}.{e}.gate_proj.{kind}", gates[e]), (f"{prefix}.{e}.up_proj.{kind}", ups[e])]
    return split


def expert_shards(parameter: str, hidden_size: int, moe: MoeArch) -> tuple[int, int] | None:
    """(shards, rows per shard) of a parameter fused from several checkpoint tensors in a sparse layer:
    a stacked projection (one shard per expert) or the shared expert's gate/up; None for any other."""
    if parameter.endswith(("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight")):
        return moe.num_experts, moe.expert_intermediate_size
    if parameter.endswith("mlp.experts.down_proj.weight"):
        return moe.num_experts, hidden_size
    if parameter.endswith("mlp.shared_expert.gate_up_proj.weight"):
        return 2, moe.shared_expert_intermediate_size
    if parameter.endswith("mlp.shared_experts.gate_up_proj.weight"):
        return 2, moe.shared_experts_intermediate_size
    return None
