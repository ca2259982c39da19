"""Qwen2-Audio: the Qwen2 decoder, and a Whisper-style audio encoder whose rows replace the prompt's
`<|AUDIO|>` placeholder tokens.

Owns what the audio model adds to the Llama-family decoder (llama.py, reused as is): the checkpoint's names
(`audio_tower.*`, `multi_modal_projector.*`, `language_model.model.*` / `language_model.lm_head.*`, or
transformers 5's `model.`-prefixed spelling), the checks of a prompt's audio items, the encoder call over a
step's clips (`encode`) and the splice of its rows into the input embeddings (`forward(..., media=)`).

Positions are plain 1-D RoPE: an audio row is one position like a text token. `mrope_positions` (the
multimodal protocol of registry.py) gives every axis the same numbers and a delta of 0, and forward reads
the first axis, so the runner's media path (runner/media.py) serves this model unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from serval.runner.models.arch import ArchConfig
from serval.runner.models.llama import LlamaForCausalLM
from serval.runner.models.qwen2_audio_encoder import (
    AudioEncoder,
    AudioProjector,
    num_audio_tokens,
    num_input_frames,
)

if TYPE_CHECKING:
    from serval.runner.attention.backend import StepAttention
    from serval.runner.lora import LoraBatch
    from serval.runner.media import MediaInput, MediaRows


class Qwen2AudioForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, arch: ArchConfig, max_positions: int):
        if arch.audio is None:
            raise ValueError(f"{arch.architecture}: config.json has no audio_config")
        super().__init__(arch, max_positions)
        self.audio_tower = AudioEncoder(arch.audio)
        self.multi_modal_projector = AudioProjector(arch.audio, arch.hidden_size)

    # ---- weights

    def weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.removeprefix("model.")
        if name.startswith(("audio_tower.", "multi_modal_projector.")):
            return name, None
        # language_model.model.layers.0... (the released spelling) or language_model.layers.0... (transformers
        # 5's, under model.); language_model.lm_head.weight or lm_head.weight.
        return super().weight_target(name.removeprefix("language_model."))

    # ---- media items and their positions

    def check_media(self, prompt_token_ids: list[int], items: Sequence[MediaInput]) -> None:
        """ValueError unless every item (by offset) is a clip that fits the prompt and the encoder: its run
        inside the prompt, apart from the others, all its rows the <|AUDIO|> id, its features one chunk of
        num_mel_bins, its frame count within the chunk and giving num_tokens rows."""
        audio = self.arch.audio
        previous_end = 0
        for item in items:
            if not item.is_audio:
                raise ValueError("a media item is not an audio clip: this model reads only audio")
            if not (previous_end <= item.offset and item.end <= len(prompt_token_ids)):
                raise ValueError(
                    f"a media item's run [{item.offset}, {item.end}) is outside the prompt or overlaps"
                )
            expected = (audio.num_mel_bins, audio.chunk_frames)
            if tuple(item.input_features.shape) != expected:
                raise ValueError(f"a clip's features are {tuple(item.input_features.shape)}, not {expected}")
            if not 1 <= item.num_feature_frames <= audio.chunk_frames:
                raise ValueError(
                    f"a clip has {item.num_feature_frames} frames, not 1 to {audio.chunk_frames}"
                )
            if item.num_tokens != num_audio_tokens(item.num_feature_frames):
                raise ValueError(
                    f"a clip of {item.num_feature_frames} frames has {item.num_tokens} rows, "
                    f"not {num_audio_tokens(item.num_feature_frames)}"
                )
            if any(token != audio.audio_token_id for token in prompt_token_ids[item.offset : item.end]):
                raise ValueError(
                    f"the prompt's run [{item.offset}, {item.end}) is not all placeholder id {audio.audio_token_id}"
                )
            previous_end = item.end

    def mrope_positions(self, num_tokens: int, items: Sequence[MediaInput]) -> tuple[torch.Tensor, int]:
        """Plain positions on all three axes, and no delta: audio rows count as tokens."""
        return torch.arange(num_tokens).expand(3, -1), 0

    @property
    def max_position(self) -> int:
        return self.rotary.cos.shape[0] - 1

    # ---- the encoder and the forward pass

    def encode(self, items: Sequence[MediaInput]) -> torch.Tensor:
        """Every clip's rows in one batched call: (sum of num_tokens, hidden_size) in the compute dtype."""
        device = self.embed_tokens.weight.device
        num_frames = torch.tensor([item.num_feature_frames for item in items])
        # Only the frames the longest clip's rows depend on (qwen2_audio_encoder.py): the rest of each chunk
        # is padding every clip masks.
        num_read = num_input_frames(int(num_frames.max()), self.arch.audio.chunk_frames)
        features = torch.stack([item.input_features[:, :num_read] for item in items]).to(device)
        rows = self.audio_tower(features, num_frames)  # (num_clips, num_read // 4, d_model)
        kept = torch.cat([clip[: item.num_tokens] for clip, item in zip(rows, items)])
        return self.multi_modal_projector(kept)

    def forward(
        self,
        input_ids: torch.Tensor,  # (num_tokens,)
        positions: torch.Tensor,  # (num_tokens,), or (3, num_tokens) in a step with prompt rows of a clip
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepAttention,
        logit_rows: torch.Tensor,
        lora: LoraBatch | None = None,
        media: MediaRows | None = None,  # encoder rows that replace their tokens' embeddings
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        if media is not None:
            x[media.rows] = media.embeddings.float()
        if positions.dim() == 2:  # mrope_positions' three equal axes
            positions = positions[0]
        rope = self.rotary.tables(positions, self.embed_tokens.weight.dtype)
        return self.forward_embedded(x, rope, kv_caches, meta, logit_rows, lora)
