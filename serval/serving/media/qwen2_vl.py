"""Qwen2VLProcessor: the MediaProcessor of Qwen2-VL and Qwen2.5-VL checkpoints (images and video).

Owns the model's side of the prompt and its encoder's input, read from the model directory:
- the run of an item: `<|vision_start|>`, one `<|image_pad|>` (`<|video_pad|>`) per merged patch, then
  `<|vision_end|>`, as the model's chat template writes it; usage counts the whole run, markers included;
- the encoder input (`encoder_input`, run in the loader's decoding threads): pixels scaled to [0, 1],
  normalized by preprocessor_config.json's image_mean and image_std, and cut into patch_size x patch_size
  patches of temporal_patch_size frames (an image is its own frame twice; a video's frames are padded with
  its last frame to a whole number of pairs), rows in the order the vision tower expects (each
  merge_size x merge_size group of neighbours consecutive), with their grid (t, h, w);
- a video's seconds per temporal patch (Qwen2.5-VL's M-RoPE spaces video time by it).
Resizing happened already (decode.py's smart_resize, with the bounds read here).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from serval.runner.media import MediaInput
from serval.serving.media.decode import Decoded, DecodedImage, DecodedVideo
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import MediaItem, read_resize_bounds
from serval.serving.media.resize import ResizeBounds

# CLIP's statistics: Qwen2-VL's preprocessor_config.json values, used where a file leaves them out.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen2VLMediaConfig:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_model_dir(cls, directory: str) -> Qwen2VLMediaConfig:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        path = os.path.join(directory, "preprocessor_config.json")
        with open(path, encoding="utf-8") as f:
            pre = json.load(f)
        vision = config.get("vision_config") or {}
        return cls(
            patch_size=int(pre.get("patch_size", vision.get("patch_size", 14))),
            merge_size=int(pre.get("merge_size", vision.get("spatial_merge_size", 2))),
            temporal_patch_size=int(pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
            image_mean=tuple(float(x) for x in pre.get("image_mean", CLIP_MEAN)),
            image_std=tuple(float(x) for x in pre.get("image_std", CLIP_STD)),
            image_token_id=int(config["image_token_id"]),
            video_token_id=int(config["video_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
            vision_end_token_id=int(config["vision_end_token_id"]),
        )


class Qwen2VLProcessor:
    accepts = frozenset({MediaKind.IMAGE, MediaKind.VIDEO})

    def __init__(self, config: Qwen2VLMediaConfig, resize_bounds: ResizeBounds) -> None:
        self.config = config
        self.resize_bounds = resize_bounds

    @classmethod
    def from_model_dir(cls, directory: str) -> Qwen2VLProcessor:
        return cls(Qwen2VLMediaConfig.from_model_dir(directory), read_resize_bounds(directory))

    def grid(self, decoded: Decoded) -> tuple[int, int, int]:
        """(temporal patches, patch rows, patch columns) of an image or video."""
        c = self.config
        if isinstance(decoded, DecodedImage):
            num_frames, (height, width) = 1, decoded.pixels.shape[:2]
        else:
            assert isinstance(decoded, DecodedVideo)
            num_frames, height, width = decoded.frames.shape[:3]
        factor = c.patch_size * c.merge_size
        if height % factor or width % factor:
            raise ValueError(f"{width}x{height} pixels are not whole {factor}-pixel merged patches")
        return -(-num_frames // c.temporal_patch_size), height // c.patch_size, width // c.patch_size

    def num_tokens(self, decoded: Decoded) -> int:
        t, h, w = self.grid(decoded)
        return t * h * w // self.config.merge_size**2 + 2  # the pads, between vision_start and vision_end

    def placeholder_ids(self, item: MediaItem) -> list[int]:
        c = self.config
        pad = c.video_token_id if item.kind is MediaKind.VIDEO else c.image_token_id
        return [c.vision_start_token_id, *[pad] * (item.num_tokens - 2), c.vision_end_token_id]

    def prompt_placeholder(self, kind: MediaKind) -> list[int]:
        c = self.config
        pad = c.video_token_id if kind is MediaKind.VIDEO else c.image_token_id
        return [c.vision_start_token_id, pad, c.vision_end_token_id]

    def encoder_input(self, decoded: Decoded, content_hash: bytes) -> MediaInput:
        """The item's encoder input; its offset is within the item's run (the rows after vision_start)."""
        c = self.config
        grid = self.grid(decoded)
        is_video = isinstance(decoded, DecodedVideo)
        frames = decoded.frames if is_video else decoded.pixels[None]  # (num_frames, H, W, 3) uint8
        seconds_per_grid = 1.0
        if is_video:
            seconds_per_grid = c.temporal_patch_size * decoded.duration / len(decoded.frames)
        key = hashlib.blake2b(content_hash, digest_size=16)
        key.update(struct.pack("<3id", *grid, seconds_per_grid))  # how it was prepared, too
        return MediaInput(
            offset=1,
            num_tokens=self.num_tokens(decoded) - 2,
            content_hash=key.digest(),
            is_video=is_video,
            grid=grid,
            pixel_values=torch.from_numpy(self.patchify(frames)),
            seconds_per_grid=seconds_per_grid,
        )

    def patchify(self, frames: np.ndarray) -> np.ndarray:
        """(num_frames, H, W, 3) uint8 -> (t * h * w, 3 * temporal_patch_size * patch_size**2) float32: the
        normalized pixels of every patch, channel-major, rows grouped by merge group."""
        c = self.config
        p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
        x = frames.astype(np.float32) * np.float32(1 / 255)
        x = (x - np.asarray(c.image_mean, np.float32)) / np.asarray(c.image_std, np.float32)
        x = x.transpose(0, 3, 1, 2)  # (num_frames, 3, H, W)
        if len(x) % tp:  # a whole number of frame groups: the last frame repeated (an image: twice)
            x = np.concatenate([x, np.repeat(x[-1:], tp - len(x) % tp, axis=0)])
        num_frames, channels, height, width = x.shape
        gt, gh, gw = num_frames // tp, height // p, width // p
        x = x.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
        # -> (gt, gh / m, gw / m, m, m, channels, tp, p, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x.reshape(gt * gh * gw, channels * tp * p * p))
