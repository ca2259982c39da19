"""Media in the runner: the encoder inputs a prompt carries, their per-prompt state, one step's share of it.

Owns the contract between serving's MediaProcessor and a multimodal model (MediaInput), the state of one
prompt with media (MediaPrompt: its M-RoPE positions, computed once when the request is added, and the
encoder outputs of the items the prefill is inside of), and how a step uses them (`media_step`): which rows
of the flat batch get encoder rows instead of token embeddings, and the 3-D positions of the step's rows.

Lifetimes: the engine's request holds its MediaPrompt (a beam's forks share it) and drops it when the request
finishes or is aborted, so nothing here outlives its request. An item is encoded the first time a step's
rows reach into its run (the encoder runs once over every such item of the step, whatever request it
belongs to), and its output is dropped as soon as the step that computes its run's last row is done: a
preempted request recomputes and encodes again (pixel values stay with the prompt for that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MediaInput:
    """One media item of a prompt, as the served model's MediaProcessor prepared it (serving/media)."""

    offset: int  # the prompt position of the first row the encoder's output replaces
    num_tokens: int  # rows replaced: the encoder's output length for this item
    # Names the content and how it was prepared: the prefix cache mixes it into the hash of every block that
    # holds one of the item's rows (equal placeholder ids must not mean equal blocks).
    content_hash: bytes
    # An image or video (Qwen2-VL): its patch grid and pixel patches.
    is_video: bool = False
    grid: tuple[int, int, int] = (0, 0, 0)  # (temporal patches, patch rows, patch columns)
    # (t * h * w, channels * temporal_patch * patch**2) fp32; None for audio
    pixel_values: torch.Tensor | None = field(default=None, repr=False)
    seconds_per_grid: float = 1.0  # a video's seconds per temporal patch (Qwen2.5-VL's M-RoPE time scale)
    # An audio clip (Qwen2-Audio): its log-mel features over one whole chunk, padding included, and how many
    # of their frames are the clip (the encoder masks the rest).
    input_features: torch.Tensor | None = field(default=None, repr=False)  # (num_mel_bins, chunk frames) fp32
    num_feature_frames: int = 0

    @property
    def is_audio(self) -> bool:
        return self.input_features is not None

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


class MediaPrompt:
    """The runner's state of one prompt with media (built by ModelRunner.prepare_media)."""

    def __init__(self, items: tuple[MediaInput, ...], positions: torch.Tensor, position_delta: int):
        self.items = items  # by offset
        self.positions = positions  # (3, num_prompt_tokens) int64: t, h, w position of every prompt token
        # Position of output token i (counted over the whole context): i + position_delta (Qwen2-VL's
        # rope_deltas: the prompt's largest position + 1 - its length).
        self.position_delta = position_delta
        self.encoded: dict[
            int, torch.Tensor
        ] = {}  # item index -> its encoder rows, while its run is computed

    @property
    def num_prompt_tokens(self) -> int:
        return self.positions.shape[1]

    def step_positions(self, start: int, count: int) -> torch.Tensor:
        """(3, count) positions of context tokens [start, start + count)."""
        end = start + count
        prompt_end = min(end, self.num_prompt_tokens)
        parts = [self.positions[:, start:prompt_end]] if start < prompt_end else []
        if end > prompt_end:
            after = torch.arange(max(start, prompt_end), end) + self.position_delta
            parts.append(after.expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def items_within(self, start: int, end: int) -> list[int]:
        """Indices of the items with a row in [start, end)."""
        return [i for i, item in enumerate(self.items) if item.offset < end and start < item.end]


@dataclass
class MediaRows:
    """One step's encoder rows, spliced into the input embeddings by the model."""

    rows: torch.Tensor  # (num_rows,) int64 rows of the flat batch
    embeddings: torch.Tensor  # (num_rows, hidden_size)


def media_step(
    model, prompts: list[MediaPrompt | None], num_new_tokens: list[int], num_computed_tokens: list[int]
) -> tuple[torch.Tensor, MediaRows | None]:
    """The step's positions, (num_tokens,) or (3, num_tokens) when some row's axes differ, and its encoder
    rows. `prompts`: per sequence of the batch, its MediaPrompt or None (text: 1-D positions)."""
    is_in_prompt = any(
        p is not None and c < p.num_prompt_tokens for p, c in zip(prompts, num_computed_tokens)
    )
    if not is_in_prompt:  # decodes and text: every axis is the same position, shifted by the request's delta
        positions: list[int] = []
        for prompt, num_new, num_computed in zip(prompts, num_new_tokens, num_computed_tokens):
            delta = 0 if prompt is None else prompt.position_delta
            positions.extend(range(num_computed + delta, num_computed + num_new + delta))
        return torch.tensor(positions, dtype=torch.long), None
    parts = []
    for prompt, num_new, num_computed in zip(prompts, num_new_tokens, num_computed_tokens):
        if prompt is None:
            parts.append(torch.arange(num_computed, num_computed + num_new).expand(3, -1))
        else:
            parts.append(prompt.step_positions(num_computed, num_new))
    _encode_missing(model, prompts, num_new_tokens, num_computed_tokens)
    return torch.cat(parts, dim=1), _rows(prompts, num_new_tokens, num_computed_tokens)


def _encode_missing(model, prompts, num_new_tokens, num_computed_tokens) -> None:
    """Encode, in one call, every item this step reaches into whose output is not held yet."""
    missing: list[tuple[MediaPrompt, int]] = []
    for prompt, num_new, num_computed in zip(prompts, num_new_tokens, num_computed_tokens):
        if prompt is not None:
            for i in prompt.items_within(num_computed, num_computed + num_new):
                if i not in prompt.encoded and (prompt, i) not in missing:
                    missing.append((prompt, i))
    if not missing:
        return
    items = [prompt.items[i] for prompt, i in missing]
    outputs = model.encode(items)  # (sum of num_tokens, hidden_size)
    for (prompt, i), rows in zip(missing, outputs.split([item.num_tokens for item in items])):
        prompt.encoded[i] = rows


def _rows(prompts, num_new_tokens, num_computed_tokens) -> MediaRows | None:
    rows, embeddings, done = [], [], []
    start = 0  # the sequence's first row in the flat batch
    for prompt, num_new, num_computed in zip(prompts, num_new_tokens, num_computed_tokens):
        if prompt is not None:
            end = num_computed + num_new
            for i in prompt.items_within(num_computed, end):
                item = prompt.items[i]
                first, last = max(item.offset, num_computed), min(item.end, end)
                rows.append(torch.arange(first, last) - num_computed + start)
                embeddings.append(prompt.encoded[i][first - item.offset : last - item.offset])
                if last == item.end:
                    done.append((prompt, i))
        start += num_new
    for prompt, i in done:  # its run is computed: a recompute (after preemption) encodes it again
        prompt.encoded.pop(i, None)
    if not rows:
        return None
    return MediaRows(torch.cat(rows), torch.cat(embeddings))
