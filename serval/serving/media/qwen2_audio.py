"""Qwen2AudioProcessor: the MediaProcessor of Qwen2-Audio checkpoints (audio clips).

Owns the model's side of the prompt and its encoder's input, read from the model directory:
- the run of a clip: `<|audio_bos|>`, one `<|AUDIO|>` per encoder row, then `<|audio_eos|>`, as the model's
  chat template writes it; usage counts the whole run, markers included;
- the encoder input (`encoder_input`, run in the loader's decoding threads): the log-mel features that the
  checkpoint's WhisperFeatureExtractor (preprocessor_config.json) computes, here in torch: the 16 kHz mono
  samples cut to one chunk (chunk_length seconds, 30 in the released models) and padded with zeros to it, a
  Hann-windowed STFT (n_fft, hop_length), the power spectrum through Slaney-normalized mel filters, log10,
  floored at 8 below the clip's maximum, then (x + 4) / 4; and how many frames are the clip's own (one per
  hop_length samples, rounded up: what the extractor's attention mask counts).

NOTE: a clip longer than one chunk is cut to it, as transformers' processor cuts it (truncation=True): the
encoder reads one chunk. Dithering (a random extractor option the released models leave at 0) is not done,
so equal clips always give equal features and share prefix-cache blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from serval.runner.media import MediaInput
from serval.runner.models.qwen2_audio_encoder import num_audio_tokens
from serval.serving.media.decode import AUDIO_SAMPLE_RATE, Decoded, DecodedAudio
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import MediaItem
from serval.serving.media.resize import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, ResizeBounds


@dataclass(frozen=True)
class WhisperFeatureConfig:
    """WhisperFeatureExtractor's settings (preprocessor_config.json; its defaults where a key is missing)."""

    num_mel_bins: int  # feature_size
    sampling_rate: int
    hop_length: int
    n_fft: int
    chunk_samples: int  # chunk_length seconds of samples: every clip is padded or cut to this
    padding_value: float

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // self.hop_length

    def num_frames(self, num_samples: int) -> int:
        """The frames of a clip of num_samples (cut to the chunk): what the extractor's mask counts."""
        return -(-min(num_samples, self.chunk_samples) // self.hop_length)

    @classmethod
    def from_model_dir(cls, directory: str) -> WhisperFeatureConfig:
        with open(os.path.join(directory, "preprocessor_config.json"), encoding="utf-8") as f:
            pre = json.load(f)
        sampling_rate = int(pre.get("sampling_rate", 16000))
        if sampling_rate != AUDIO_SAMPLE_RATE:
            raise ValueError(
                f"preprocessor_config.json's sampling_rate is {sampling_rate}; serval decodes audio at "
                f"{AUDIO_SAMPLE_RATE} Hz"
            )
        if pre.get("do_normalize"):
            raise ValueError("preprocessor_config.json's do_normalize is not supported")
        return cls(
            num_mel_bins=int(pre.get("feature_size", 80)),
            sampling_rate=sampling_rate,
            hop_length=int(pre.get("hop_length", 160)),
            n_fft=int(pre.get("n_fft", 400)),
            chunk_samples=int(pre.get("chunk_length", 30)) * sampling_rate,
            padding_value=float(pre.get("padding_value", 0.0)),
        )


def mel_filters(num_frequency_bins: int, num_mel_bins: int, sampling_rate: int) -> torch.Tensor:
    """(num_frequency_bins, num_mel_bins) triangular filters, evenly spaced on the Slaney mel scale from 0 Hz
    to 8 kHz, each scaled to unit area (Slaney norm): Whisper's filter bank."""

    def hz_to_mel(hz: np.ndarray) -> np.ndarray:  # linear below 1 kHz, logarithmic above
        log_step = math.log(6.4) / 27.0
        return np.where(
            hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / log_step, 3.0 * hz / 200.0
        )

    def mel_to_hz(mel: np.ndarray) -> np.ndarray:
        log_step = math.log(6.4) / 27.0
        return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), 200.0 * mel / 3.0)

    fft_hz = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    mel_edges = np.linspace(hz_to_mel(np.array(0.0)), hz_to_mel(np.array(8000.0)), num_mel_bins + 2)
    edges_hz = mel_to_hz(mel_edges)  # (num_mel_bins + 2,): each filter's left, centre and right
    widths = np.diff(edges_hz)
    slopes = edges_hz[None, :] - fft_hz[:, None]  # (num_frequency_bins, num_mel_bins + 2)
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= 2.0 / (edges_hz[2:] - edges_hz[:-2])
    return torch.from_numpy(filters).float()


class Qwen2AudioProcessor:
    accepts = frozenset({MediaKind.AUDIO})
    resize_bounds = ResizeBounds(28, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)  # the protocol's; no images here

    def __init__(
        self, features: WhisperFeatureConfig, audio_token_id: int, audio_bos_id: int, audio_eos_id: int
    ) -> None:
        self.features = features
        self.audio_token_id = audio_token_id
        self.audio_bos_id = audio_bos_id
        self.audio_eos_id = audio_eos_id
        self.filters = mel_filters(1 + features.n_fft // 2, features.num_mel_bins, features.sampling_rate)
        self.window = torch.hann_window(features.n_fft)

    @classmethod
    def from_model_dir(cls, directory: str) -> Qwen2AudioProcessor:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        audio_token_id = int(config.get("audio_token_index", config.get("audio_token_id", 151646)))
        bos, eos = _token_ids(directory, ("<|audio_bos|>", "<|audio_eos|>"))
        return cls(WhisperFeatureConfig.from_model_dir(directory), audio_token_id, bos, eos)

    def num_tokens(self, decoded: Decoded) -> int:
        assert isinstance(decoded, DecodedAudio)
        num_rows = num_audio_tokens(self.features.num_frames(len(decoded.samples)))
        if num_rows < 1:
            raise ValueError(f"the audio is too short for one encoder row ({len(decoded.samples)} samples)")
        return num_rows + 2  # with bos and eos

    def placeholder_ids(self, item: MediaItem) -> list[int]:
        return [self.audio_bos_id, *[self.audio_token_id] * (item.num_tokens - 2), self.audio_eos_id]

    def prompt_placeholder(self, kind: MediaKind) -> list[int]:
        return [self.audio_bos_id, self.audio_token_id, self.audio_eos_id]

    def encoder_input(self, decoded: Decoded, content_hash: bytes) -> MediaInput:
        """The clip's encoder input; its offset is within the clip's run (the rows after audio_bos)."""
        assert isinstance(decoded, DecodedAudio)
        num_frames = self.features.num_frames(len(decoded.samples))
        key = hashlib.blake2b(content_hash, digest_size=16)
        key.update(struct.pack("<2i", self.features.chunk_samples, num_frames))  # how it was prepared, too
        return MediaInput(
            offset=1,
            num_tokens=num_audio_tokens(num_frames),
            content_hash=key.digest(),
            input_features=self.log_mel(decoded.samples),
            num_feature_frames=num_frames,
        )

    def log_mel(self, samples: np.ndarray) -> torch.Tensor:
        """(num_samples,) float32 at 16 kHz -> (num_mel_bins, chunk_frames) float32 features."""
        f = self.features
        waveform = torch.full((f.chunk_samples,), f.padding_value, dtype=torch.float32)
        clip = torch.from_numpy(np.ascontiguousarray(samples[: f.chunk_samples], dtype=np.float32))
        waveform[: len(clip)] = clip
        stft = torch.stft(waveform, f.n_fft, f.hop_length, window=self.window, return_complex=True)
        power = stft[:, :-1].abs() ** 2  # (n_fft // 2 + 1, chunk_frames): the last frame is dropped
        log_spec = (self.filters.T @ power).clamp(min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0


def _token_ids(directory: str, tokens: tuple[str, ...]) -> list[int]:
    """The ids of special tokens, from the directory's tokenizer.json."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    ids = [tokenizer.token_to_id(token) for token in tokens]
    missing = [token for token, i in zip(tokens, ids) if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token")
    return ids
