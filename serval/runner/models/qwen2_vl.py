"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with M-RoPE, and a vision tower whose rows replace the prompt's
image and video placeholder tokens.

Owns what the multimodal model adds to the Llama-family decoder (llama.py, reused as is): the checkpoint's
names (`visual.*`, or transformers 5's `model.visual.*` / `model.language_model.*`), the M-RoPE positions of a
prompt (`mrope_positions`, once per request), the rotary tables of 3-D positions, the encoder call over a
step's items (`encode`), and the splice of its rows into the input embeddings (`forward(..., media=)`).

M-RoPE: each rotary frequency turns with one of three position axes (mrope_section: how many frequencies
follow t, h and w). Text tokens have the same position on all three, so a step without vision rows in it
(every decode) passes 1-D positions and runs exactly the text model's path, the DecodeStack included; only
the position numbers are shifted by the request's delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from serval.runner.layers import RopeTables, RotaryEmbedding, rope_inverse_frequencies
from serval.runner.models.arch import ArchConfig
from serval.runner.models.llama import LlamaForCausalLM
from serval.runner.models.qwen2_vl_vision import VisionAttention, VisionTower

if TYPE_CHECKING:
    from serval.runner.attention.backend import StepAttention
    from serval.runner.lora import LoraBatch
    from serval.runner.media import MediaInput, MediaRows


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, arch: ArchConfig, max_positions: int):
        if arch.vision is None:
            raise ValueError(f"{arch.architecture}: config.json has no vision_config")
        half = arch.head_dim // 2
        if not arch.mrope_section or sum(arch.mrope_section) != half:
            raise ValueError(
                f"{arch.architecture}: rope_scaling.mrope_section {list(arch.mrope_section)} must sum to "
                f"head_dim / 2 = {half}"
            )
        super().__init__(arch, max_positions)
        self.visual = VisionTower(arch.vision)
        # Which position axis (0 t, 1 h, 2 w) each rotary frequency follows: section i follows axis i % 3.
        axes = [i % 3 for i, n in enumerate(arch.mrope_section) for _ in range(n)]
        self.frequency_axes = torch.tensor(axes, dtype=torch.long, device="cpu")  # (head_dim // 2,)

    # ---- weights

    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.removeprefix("model.")
        if name.startswith("visual."):
            return name, None
        return super().weight_target(name.replace("language_model.", "", 1))

    # ---- media items and their positions

    def check_media(self, prompt_token_ids: list[int], items: Sequence[MediaInput]) -> None:
        """ValueError unless every item (by offset) fits the prompt and the tower: its run inside the
        prompt, apart from the others, all its rows the placeholder id of its kind, its grid and pixel
        values the shape the tower makes num_tokens rows of."""
        vision = self.arch.vision
        m = vision.spatial_merge_size
        previous_end = 0
        for item in items:
            if item.pixel_values is None:
                raise ValueError("a media item is not an image or video: this model reads only those")
            t, h, w = item.grid
            if not (previous_end <= item.offset and item.end <= len(prompt_token_ids)):
                raise ValueError(
                    f"a media item's run [{item.offset}, {item.end}) is outside the prompt or overlaps"
                )
            if t < 1 or h < m or w < m or h % m or w % m or (t != 1 and not item.is_video):
                raise ValueError(f"a media item's grid {item.grid} does not fit the encoder (merge size {m})")
            if item.num_tokens != t * h * w // (m * m):
                raise ValueError(
                    f"a media item of grid {item.grid} has {item.num_tokens} rows, not {t * h * w // m**2}"
                )
            expected = (t * h * w, vision.patch_dim)
            if tuple(item.pixel_values.shape) != expected:
                raise ValueError(
                    f"a media item's pixel values are {tuple(item.pixel_values.shape)}, not {expected}"
                )
            placeholder = vision.video_token_id if item.is_video else vision.image_token_id
            if any(token != placeholder for token in prompt_token_ids[item.offset : item.end]):
                raise ValueError(
                    f"the prompt's run [{item.offset}, {item.end}) is not all placeholder id {placeholder}"
                )
            previous_end = item.end

    def mrope_positions(self, num_tokens: int, items: Sequence[MediaInput]) -> tuple[torch.Tensor, int]:
        """The (3, num_tokens) int64 positions of a prompt whose media items sit at `items`' offsets, and the
        delta that continues them after the prompt (output token i is at i + delta on every axis).

        Text advances all three axes by one a token. An item's rows are at (start + t * interval, start +
        row, start + column) over its merged grid (interval: 1, or for a Qwen2.5-VL video tokens_per_second
        x its seconds per temporal patch); the text after it continues from the largest position + 1."""
        vision = self.arch.vision
        m = vision.spatial_merge_size
        parts, next_position, cursor = [], 0, 0
        for item in sorted(items, key=lambda item: item.offset):
            num_text = item.offset - cursor
            parts.append(torch.arange(next_position, next_position + num_text).expand(3, -1))
            next_position += num_text
            t, h, w = item.grid[0], item.grid[1] // m, item.grid[2] // m
            interval = 1.0
            if item.is_video and vision.is_qwen2_5:
                interval = vision.tokens_per_second * item.seconds_per_grid
            axes = torch.meshgrid(
                (torch.arange(t) * interval).long(), torch.arange(h), torch.arange(w), indexing="ij"
            )
            grid = torch.stack([axis.reshape(-1) for axis in axes]) + next_position  # (3, t * h * w)
            parts.append(grid)
            next_position = int(grid.max()) + 1
            cursor = item.end
        parts.append(torch.arange(next_position, next_position + num_tokens - cursor).expand(3, -1))
        next_position += num_tokens - cursor
        return torch.cat(parts, dim=1), next_position - num_tokens

    def mrope_tables(self, positions: torch.Tensor) -> RopeTables:
        """The rotary tables of (3, num_tokens) positions: each frequency's angle from its own axis."""
        cos = self.rotary.cos[positions]  # (3, num_tokens, head_dim // 2)
        sin = self.rotary.sin[positions]
        index = self.frequency_axes.to(cos.device).expand(1, cos.shape[1], -1)
        return RopeTables(
            cos.gather(0, index)[0],
            sin.gather(0, index)[0],
            self.embed_tokens.weight.dtype,
            self.rotary.native_kernel,
        )

    @property
    def max_position(self) -> int:
        """The largest position the rotary tables hold."""
        return self.rotary.cos.shape[0] - 1

    def _make_rotary(self, freq_factors: torch.Tensor | None) -> RotaryEmbedding:
        # Past the context too: a Qwen2.5-VL video's time positions can run ahead of its token count, and
        # the output tokens continue from its largest position.
        arch = self.arch
        inv_freq = rope_inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling, freq_factors)
        size = max(self.max_positions, arch.max_position_embeddings)
        return RotaryEmbedding(arch.head_dim, size, inv_freq)

    def use_kernels(
        self, kernels, kv_caches, block_size, dtype, int8_batch_activations=False, **dense
    ) -> None:
        """The decoder's kernels (llama.py), and the vision tower's rotation through the native RoPE kernel."""
        super().use_kernels(kernels, kv_caches, block_size, dtype, int8_batch_activations, **dense)
        for module in self.visual.modules():
            if isinstance(module, VisionAttention):
                module.native_rotary = kernels.rotary_embedding_

    # ---- the encoder and the forward pass

    def encode(self, items: Sequence[MediaInput]) -> torch.Tensor:
        """Every item's encoder rows in one call: (sum of num_tokens, hidden_size) in the compute dtype."""
        device = self.embed_tokens.weight.device
        pixel_values = torch.cat([item.pixel_values for item in items]).to(device)
        return self.visual(pixel_values, [item.grid for item in items])

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,), or (3, num_tokens) for M-RoPE positions whose axes differ
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        logit_rows: torch.Tensor,
        lora: LoraBatch | None = None,
        media: MediaRows | None = None,  # encoder rows that replace their tokens' embeddings
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        if media is not None:
            x[media.rows] = media.embeddings.float()
        if positions.dim() == 2:
            rope = self.mrope_tables(positions)
        else:
            rope = self.rotary.tables(positions, self.embed_tokens.weight.dtype)
        return self.forward_embedded(x, rope, kv_caches, meta, logit_rows, lora)
