"""The seam a multimodal model plugs into: MediaProcessor, and the values media become in a prompt.

A model architecture that reads images, video or audio provides a MediaProcessor: the kinds it accepts,
its resize bounds (from its preprocessor_config.json), how many prompt positions a decoded item takes and
the token ids of that run. A text-only model provides none, and every media part is refused by name before
anything is fetched (parts.check_accepted).

With a processor, a chat request goes: parts parsed (api/media_parts.py) -> loaded (loader.py: fetched,
decoded, resized, hashed, counted; off the event loop) -> the template rendered with each user message's
media placed where its content list puts them (client_text.Segment.num_media) -> each item's run of placeholder ids spliced
into the prompt ids (`place_media`), which gives its MediaSpan. The GenerationRequest carries the spans:
the model task hands them to the engine so that (1) the runner's encoder runs once per item and its
embeddings replace the run's rows, and (2) the prefix cache folds each span's content hash into the hash of
every block the run touches, since two images' runs have identical placeholder ids.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from serval.runner.media import MediaInput
from serval.serving.media.decode import Decoded, DecodedAudio, DecodedImage, DecodedVideo
from serval.serving.media.parts import MediaKind
from serval.serving.media.resize import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, ResizeBounds


@dataclass(frozen=True)
class MediaItem:
    """One part, loaded: its decoded content, the hash that names it, and the prompt positions it takes."""

    kind: MediaKind
    decoded: Decoded
    content_hash: bytes  # blake2b of the decoded content: equal items share prefix-cache blocks
    num_tokens: int  # the length of its placeholder run
    param: str  # the part it came from (messages[i].content[j])
    # What the model's encoder reads (MediaProcessor.encoder_input), its offset within the run; None: the
    # processor has no encoder (tests' stand-ins).
    encoder_input: MediaInput | None = None


@dataclass(frozen=True)
class MediaSpan:
    """Where one item's run sits in the prompt ids."""

    offset: int  # the run's first position in the prompt
    item: MediaItem

    @property
    def num_tokens(self) -> int:
        return self.item.num_tokens


class MediaProcessor(Protocol):
    """What a multimodal model architecture provides to serving (one per served model)."""

    accepts: frozenset[MediaKind]  # the kinds its encoders read
    resize_bounds: ResizeBounds  # images and video frames (preprocessor_config.json)

    def num_tokens(self, decoded: Decoded) -> int:
        """How many prompt positions the item takes (e.g. Qwen2-VL: height * width / 28**2 for an image)."""
        ...

    def placeholder_ids(self, item: MediaItem) -> list[int]:
        """The token ids of the item's run, `item.num_tokens` long (the encoder's rows replace them)."""
        ...

    def prompt_placeholder(self, kind: MediaKind) -> list[int]:
        """The ids the model's chat template writes for one item of `kind` (its run with one placeholder):
        what a raw prompt holds where an item goes (the offline LLM's multi_modal_data)."""
        ...

    def encoder_input(self, decoded: Decoded, content_hash: bytes) -> MediaInput | None:
        """The encoder's input of a decoded item (pixel patches, ...), its offset counted from the start of
        the item's run; called in the loader's decoding threads."""
        ...


# Hugging Face architecture -> the module and class of its MediaProcessor (imported when a model needs one).
_PROCESSORS: dict[str, tuple[str, str]] = {
    "Qwen2VLForConditionalGeneration": ("serval.serving.media.qwen2_vl", "Qwen2VLProcessor"),
    "Qwen2_5_VLForConditionalGeneration": ("serval.serving.media.qwen2_vl", "Qwen2VLProcessor"),
    "Qwen2AudioForConditionalGeneration": ("serval.serving.media.qwen2_audio", "Qwen2AudioProcessor"),
}


def media_processor_for(model_dir: str) -> MediaProcessor | None:
    """The MediaProcessor of the model in a Hugging Face directory (read from its config.json and
    preprocessor_config.json), or None for a text-only model."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or [""]
    if architectures[0] not in _PROCESSORS:
        return None
    module_name, class_name = _PROCESSORS[architectures[0]]
    return getattr(importlib.import_module(module_name), class_name).from_model_dir(model_dir)


def engine_media(spans: Sequence[MediaSpan]) -> tuple[MediaInput, ...]:
    """The spans' encoder inputs at their prompt positions: what the engine request carries."""
    return tuple(
        dataclasses.replace(span.item.encoder_input, offset=span.offset + span.item.encoder_input.offset)
        for span in spans
        if span.item.encoder_input is not None
    )


def read_resize_bounds(model_dir: str) -> ResizeBounds:
    """The resize bounds a Hugging Face model directory's preprocessor_config.json gives (Qwen2-VL's keys:
    patch_size, merge_size, min_pixels, max_pixels; or size.{shortest_edge, longest_edge}, the newer
    spelling of the same two bounds); the defaults where it says nothing."""
    path = os.path.join(model_dir, "preprocessor_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS)
    max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS)
    return ResizeBounds(factor, min_pixels, max_pixels)


def content_hash(kind: MediaKind, decoded: Decoded) -> bytes:
    """A digest of what the model will see: the kind, the array's shape and dtype, and its bytes."""
    if isinstance(decoded, DecodedImage):
        array = decoded.pixels
    elif isinstance(decoded, DecodedVideo):
        array = decoded.frames
    else:
        assert isinstance(decoded, DecodedAudio)
        array = decoded.samples
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{kind.value}:{array.shape}:{array.dtype}".encode())
    digest.update(array.tobytes())
    return digest.digest()


def place_media(
    token_ids: list[int],
    slots: Sequence[int],
    items: Sequence[MediaItem],
    processor: MediaProcessor,
    num_prefix_tokens: int = 0,
) -> tuple[list[int], int, tuple[MediaSpan, ...]]:
    """The prompt with each item's run of placeholder ids inserted, the explicit-cache prefix's new length,
    and the spans. slots: for each item in order, the position in token_ids its run goes before (where the
    template put its message). ValueError when the template placed another number of media than there are."""
    if len(slots) != len(items):
        raise ValueError(f"the chat template placed {len(slots)} of the {len(items)} media parts")
    result: list[int] = []
    spans = []
    start = 0
    num_prefix = num_prefix_tokens
    for slot, item in zip(slots, items):
        run = processor.placeholder_ids(item)
        if len(run) != item.num_tokens:
            raise ValueError(f"{item.param}: the model's run is {len(run)} ids for {item.num_tokens} tokens")
        result.extend(token_ids[start:slot])
        spans.append(MediaSpan(len(result), item))
        result.extend(run)
        start = slot
        if num_prefix_tokens and slot <= num_prefix_tokens:  # a run inside the pinned prefix lengthens it
            num_prefix += len(run)
    result.extend(token_ids[start:])
    return result, num_prefix, tuple(spans)


def num_tokens_by_kind(spans: Sequence[MediaSpan]) -> dict[MediaKind, int]:
    counts = dict.fromkeys(MediaKind, 0)
    for span in spans:
        counts[span.item.kind] += span.num_tokens
    return counts
