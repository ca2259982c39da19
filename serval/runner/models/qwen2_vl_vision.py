"""The Qwen2-VL / Qwen2.5-VL vision tower: pixel patches in, one language-model-width row per merged patch.

Owns the ViT's math: the patch embedding (a Conv3d whose stride equals its kernel, so a matmul over each
flattened patch), the 2-D rotary embedding of each patch's (row, column), the blocks (attention only among
the patches of one image or video frame pair, Qwen2.5-VL also within windows), and the PatchMerger that
concatenates each spatial_merge_size x spatial_merge_size group of neighbours and projects it to the
language model's width.

Patches arrive in the order the preprocessor (serving/media/qwen2_vl.py) writes them: per item, per frame
pair, the merge groups row-major and, inside a group, its patches row-major; so a group is 4 consecutive rows
and the merger is a reshape. Several items are one call: `grids` says where each one's patches are.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from serval.runner.layers import Linear, RMSNorm, apply_rope
from serval.runner.models.arch import VisionArch

Grid = tuple[int, int, int]  # (frames / temporal_patch_size, rows, columns) of patches


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return (lambda x: F.gelu(x, approximate="tanh")) if name.endswith("tanh") else F.gelu
    raise ValueError(f"vision activation {name!r} is not supported")


def _norm(vision: VisionArch, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if vision.is_qwen2_5 else nn.LayerNorm(dim, eps=1e-6)


class PatchEmbed(nn.Module):
    def __init__(self, vision: VisionArch):
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = nn.Conv3d(vision.in_channels, vision.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # (num_patches, C * T * P * P) @ (embed_dim, C * T * P * P).T: the conv's one output per patch.
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    native_rotary = None  # kernels.rotary_embedding_ (in place, fp32 math), set by the model's use_kernels

    def __init__(self, vision: VisionArch):
        super().__init__()
        self.num_heads = vision.num_heads
        self.head_dim = vision.embed_dim // vision.num_heads
        self.qkv = Linear(vision.embed_dim, 3 * vision.embed_dim, bias=True)
        self.proj = Linear(vision.embed_dim, vision.embed_dim, bias=True)

    def forward(
        self,
        x: torch.Tensor,  # (num_patches, embed_dim)
        cos: torch.Tensor,  # (num_patches, 1, head_dim // 2) float32
        sin: torch.Tensor,
        bounds: list[int],  # attention runs within [bounds[i], bounds[i + 1])
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation in fp32, as the reference does, whatever the compute dtype.
        if self.native_rotary is not None:
            self.native_rotary(q, k, cos, sin)  # in place on the views of qkv's output
        else:
            q = apply_rope(q.float(), cos, sin).to(v.dtype)
            k = apply_rope(k.float(), cos, sin).to(v.dtype)
        # (1, num_heads, num_patches, head_dim): 4-D, so SDPA takes its fused CPU kernel, not the math path.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if len(bounds) == 2:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                    for a, b in itertools.pairwise(bounds)
                ],
                dim=2,
            )
        out = out[0].transpose(0, 1)  # (num_patches, num_heads, head_dim)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> quick_gelu -> fc2. Qwen2.5-VL: SwiGLU (gate, up, down), all with biases."""

    def __init__(self, vision: VisionArch):
        super().__init__()
        self.is_gated = vision.is_qwen2_5
        self.act = _activation(vision.hidden_act)
        if self.is_gated:
            self.gate_proj = Linear(vision.embed_dim, vision.intermediate_size, bias=True)
            self.up_proj = Linear(vision.embed_dim, vision.intermediate_size, bias=True)
            self.down_proj = Linear(vision.intermediate_size, vision.embed_dim, bias=True)
        else:
            self.fc1 = Linear(vision.embed_dim, vision.intermediate_size, bias=True)
            self.fc2 = Linear(vision.intermediate_size, vision.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionArch):
        super().__init__()
        self.norm1 = _norm(vision, vision.embed_dim)
        self.norm2 = _norm(vision, vision.embed_dim)
        self.attn = VisionAttention(vision)
        self.mlp = VisionMLP(vision)

    def forward(self, x, cos, sin, bounds):
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vision: VisionArch):
        super().__init__()
        self.merged_dim = vision.embed_dim * vision.spatial_merge_size**2
        self.ln_q = _norm(vision, vision.embed_dim)
        self.mlp = nn.Sequential(
            Linear(self.merged_dim, self.merged_dim, bias=True),
            nn.GELU(),
            Linear(self.merged_dim, vision.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))


class VisionTower(nn.Module):
    def __init__(self, vision: VisionArch):
        super().__init__()
        self.vision = vision
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        self.merger = PatchMerger(vision)

    def forward(
        self,
        pixel_values: torch.Tensor,  # (num_patches, patch_dim), the items' patches one after another
        grids: list[Grid],  # per item
    ) -> torch.Tensor:  # (num_patches // spatial_merge_size**2, out_hidden_size)
        v = self.vision
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grids)
        # Attention never crosses a frame pair (a temporal patch): each image, and each frame pair of a video,
        # is its own sequence.
        frame_bounds = _bounds([h * w for t, h, w in grids for _ in range(t)])
        if not v.is_qwen2_5:
            for block in self.blocks:
                x = block(x, cos, sin, frame_bounds)
            return self.merger(x)
        order, window_bounds = window_order(grids, v)
        x, cos, sin = x[order], cos[order], sin[order]
        for i, block in enumerate(self.blocks):
            # Qwen2.5-VL: full attention (within each frame pair) in a few blocks, windows elsewhere.
            x = block(x, cos, sin, frame_bounds if i in v.fullatt_block_indexes else window_bounds)
        merged = self.merger(x)
        group = v.spatial_merge_size**2
        restore = torch.argsort(order.view(-1, group)[:, 0])  # the merged rows back in the original order
        return merged[restore]

    def rotary(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, (num_patches, 1, head_dim // 2) float32: the first half of the frequencies turn with
        the patch's row, the second with its column."""
        v = self.vision
        head_dim = v.embed_dim // v.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        inv_freq = 1.0 / (v.rope_theta**quarter)  # (head_dim // 4,)
        rows, cols = [], []
        m = v.spatial_merge_size
        for t, h, w in grids:
            # Patch (r, c) in merge-group order: groups row-major, then the group's own m x m row-major.
            r = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m).reshape(-1)
            c = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m).reshape(-1)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        row, col = torch.cat(rows).float(), torch.cat(cols).float()
        freqs = torch.cat([torch.outer(row, inv_freq), torch.outer(col, inv_freq)], dim=1)
        device = self.merger.mlp[0].weight.device
        return freqs.cos()[:, None].to(device), freqs.sin()[:, None].to(device)


def _bounds(lengths: list[int]) -> list[int]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


def window_order(grids: list[Grid], vision: VisionArch) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the patch order that makes every window's patches consecutive, (num_patches,)
    int64, and the windows' bounds in that order. A window is window_size pixels square (whole merge groups;
    those at the right and bottom edges are cut short), within one frame pair; windows go row-major per
    frame pair, groups row-major within a window."""
    m = vision.spatial_merge_size
    side = vision.window_size // m // vision.patch_size  # merge groups along a window's side
    groups, sizes = [], []
    first = 0  # the item's first merge group
    for t, h, w in grids:
        index = torch.arange(t * (h // m) * (w // m)).view(t, h // m, w // m) + first
        for frame in index:
            for rows in frame.split(side, dim=0):
                for window in rows.split(side, dim=1):
                    groups.append(window.reshape(-1))
                    sizes.append(window.numel() * m * m)
        first += index.numel()
    group_order = torch.cat(groups)  # (num_patches // m**2,)
    order = (group_order[:, None] * m * m + torch.arange(m * m)).reshape(-1)
    return order, _bounds(sizes)
