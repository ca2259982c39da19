"""The Qwen2-Audio encoder: log-mel frames in, one language-model-width row per 40 ms of audio.

Owns Whisper's encoder math as Qwen2-Audio uses it: two conv1d (the second of stride 2, so a row per two mel
frames) with GELU, learned positions over the whole chunk, pre-norm transformer layers (LayerNorm, attention
with biases on q, v and out but not k, GELU MLP), then an average pool of 2 and a LayerNorm; and the linear
projector to the decoder's width (AudioProjector).

Every clip arrives padded to one whole chunk (serving/media/qwen2_audio.py: 30 s in the released models), as
transformers feeds it, and attention ignores the padding's rows as keys, so a clip's rows do not depend on
what else is in the call; several clips are one batched call. Only the chunk's first frames are read
(`num_input_frames`): a clip's rows depend on its frames and the two padding frames after them (the convs'
reach), and every later row is a masked key, so a 2 s clip costs 2 s of encoder, not 30, and gives the
rows the whole chunk gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serval.runner.models.arch import AudioArch


def _activation(name: str):
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"audio encoder activation {name!r} is not supported")


class AudioAttention(nn.Module):
    def __init__(self, audio: AudioArch):
        super().__init__()
        self.num_heads = audio.num_heads
        self.head_dim = audio.d_model // audio.num_heads
        self.q_proj = nn.Linear(audio.d_model, audio.d_model)
        self.k_proj = nn.Linear(audio.d_model, audio.d_model, bias=False)
        self.v_proj = nn.Linear(audio.d_model, audio.d_model)
        self.out_proj = nn.Linear(audio.d_model, audio.d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        num_clips, num_rows, width = x.shape  # x: (num_clips, num_rows, d_model)

        def heads(t: torch.Tensor) -> torch.Tensor:  # -> (num_clips, num_heads, num_rows, head_dim)
            return t.view(num_clips, num_rows, self.num_heads, self.head_dim).transpose(1, 2)

        # NOTE: q is scaled before the product, as Whisper does (the same value, rounded in the same order).
        q = heads(self.q_proj(x) * self.head_dim**-0.5)
        k, v = heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(num_clips, num_rows, width))


class AudioEncoderLayer(nn.Module):
    def __init__(self, audio: AudioArch):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(audio.d_model)
        self.self_attn = AudioAttention(audio)
        self.final_layer_norm = nn.LayerNorm(audio.d_model)
        self.fc1 = nn.Linear(audio.d_model, audio.ffn_dim)
        self.fc2 = nn.Linear(audio.ffn_dim, audio.d_model)
        self.activation = _activation(audio.activation)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(self.activation(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, audio: AudioArch):
        super().__init__()
        self.audio = audio
        self.conv1 = nn.Conv1d(audio.num_mel_bins, audio.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(audio.d_model, audio.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(
            audio.max_source_positions,
            audio.d_model,
            _weight=torch.empty(audio.max_source_positions, audio.d_model),  # the checkpoint fills it
        )
        self.layers = nn.ModuleList(AudioEncoderLayer(audio) for _ in range(audio.num_layers))
        self.layer_norm = nn.LayerNorm(audio.d_model)

    def forward(self, features: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """features: (num_clips, num_mel_bins, frames), the first frames of whole chunks (at least
        num_input_frames(num_frames.max())); num_frames: (num_clips,) int64, the frames of each that are its
        clip. -> (num_clips, frames // 4, d_model): each clip's first `num_audio_tokens(num_frames)` rows
        are its own (those the whole chunk gives), the rest come from padding."""
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (num_clips, num_input_frames / 2, d_model)
        x = x + self.embed_positions.weight[: x.shape[1]]
        num_rows = (num_frames - 1) // 2 + 1  # after conv2
        key_mask = torch.arange(x.shape[1], device=x.device)[None] < num_rows.to(x.device)[:, None]
        key_mask = key_mask[:, None, None, :]  # (num_clips, 1, 1, max_source_positions): padding is no key
        for layer in self.layers:
            x = layer(x, key_mask)
        x = F.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)


def num_input_frames(num_frames: int, chunk_frames: int) -> int:
    """The chunk's frames the encoder must read for a clip of num_frames to get its rows: the clip's, and
    the two after it that conv1 and conv2 reach into, rounded up to an even count (conv2's stride)."""
    return min(chunk_frames, num_frames + 2 + num_frames % 2)


def num_audio_tokens(num_frames: int) -> int:
    """The encoder's rows of a clip of `num_frames` mel frames: halved by conv2, then by the pool."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


class AudioProjector(nn.Module):
    """The multi-modal projector: encoder rows to the decoder's width."""

    def __init__(self, audio: AudioArch, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(audio.d_model, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
