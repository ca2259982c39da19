"""DecodeGraphs: decode-only steps replayed from captured graphs over static input buffers (CUDA graphs).

A decode step launches a few hundred small kernels for a few rows of work; on a GPU the launches, not the
arithmetic, bound it. So a decode-only step runs as one graph replay: per batch-size bucket (1, 2, 4, 8, then
multiples of 16), the model's forward is captured once over static device buffers (token ids, positions,
slots, block tables, context lengths), and each step copies its inputs into them and replays the bucket
that fits. Rows past the step's sequences are padding: token 0 at position 0, a context of one token in a
block the engine never hands out (`pad_block`), so they write and read only that block. Prefill and mixed
steps, LoRA and media steps, and batches past the largest bucket run eagerly; so does every step once a
capture has failed (logged).

What is CUDA-only is the capture itself (cuda_graph.py: `CudaGraphCapture`), passed in as `capture`; with
`replay_eagerly` the same buffers and padding run on any device, which is how the CPU tests check all of
this module against the eager path (under Triton's interpreter).

NOTE: all graphs share one memory pool. That is safe because replays never overlap (one engine thread, one
stream) and each replay's logits are read before the next replay, which may reuse their memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serval.runner.attention.backend import StepAttention
from serval.runner.attention.triton_paged import TritonDecodes, TritonMetadata, TritonPagedBackend
from serval.runner.batch import Batch

logger = logging.getLogger(__name__)

# capture(run) -> replay: `run()` computes the step over the static buffers and returns its logits; replay()
# recomputes them for the buffers' current contents and returns the (same) output tensor.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def replay_eagerly(run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A `Capture` that records nothing: each replay runs the forward again (any device; the CPU tests)."""
    return run


def decode_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 16, up to the first that holds max_batch."""
    buckets = [1, 2, 4, 8]
    while buckets[-1] < max_batch:
        buckets.append(buckets[-1] * 2 if buckets[-1] < 16 else buckets[-1] + 16)
    return [b for b in buckets if b < max_batch] + [next(b for b in buckets if b >= max_batch)]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows; None past the largest (the step runs eagerly)."""
    return next((b for b in buckets if b >= num_seqs), None)


@dataclass(frozen=True)
class PaddedDecode:
    """One decode step's inputs padded to its bucket, on the host (padded_decode_inputs)."""

    input_ids: torch.Tensor  # (bucket,) int64
    positions: torch.Tensor  # (bucket,) int64
    slot_mapping: torch.Tensor  # (bucket,) int64: where each row's new K/V goes
    block_tables: torch.Tensor  # (bucket, max_blocks) int32
    context_lens: torch.Tensor  # (bucket,) int32


def padded_decode_inputs(
    token_ids: list[int],
    num_computed_tokens: list[int],
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int64
    block_size: int,
    bucket: int,
    pad_block: int,
) -> PaddedDecode:
    """A decode-only step's inputs as the graph of `bucket` reads them: its rows, then padding rows (token 0
    at position 0, one token of context in pad_block, written at its first slot)."""
    num_seqs, max_blocks = block_tables.shape
    num_pad = bucket - num_seqs
    computed = torch.tensor(num_computed_tokens, dtype=torch.long)
    blocks = block_tables.gather(1, (computed // block_size).unsqueeze(1)).squeeze(1)
    slots = blocks * block_size + computed % block_size
    tables = torch.full((bucket, max_blocks), pad_block, dtype=torch.int32)
    tables[:num_seqs, :max_blocks] = block_tables
    return PaddedDecode(
        input_ids=torch.tensor(token_ids + [0] * num_pad, dtype=torch.long),
        positions=torch.cat([computed, torch.zeros(num_pad, dtype=torch.long)]),
        slot_mapping=torch.cat([slots, torch.full((num_pad,), pad_block * block_size, dtype=torch.long)]),
        block_tables=tables,
        context_lens=torch.cat([computed + 1, torch.ones(num_pad, dtype=torch.long)]).to(torch.int32),
    )


def is_graph_step(batch: Batch) -> bool:
    """A decode-only step that samples every sequence once, with no adapter, media or logit-row request."""
    return (
        len(batch.token_ids) == batch.num_seqs
        and batch.sample_indices == list(range(batch.num_seqs))
        and not batch.num_logit_rows
        and not batch.lora_slots
        and not batch.media
    )


class DecodeGraphs:
    """Captured decode steps of one model over its KV caches, a graph per bucket, captured on first use."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int,
        pad_block: int,
        device: torch.device,
        capture: Capture,
    ):
        self.model, self.kv_caches, self.capture = model, kv_caches, capture
        self.block_size, self.pad_block = block_size, pad_block
        self.buckets = decode_buckets(max_batch)
        size = self.buckets[-1]
        # The static buffers every graph reads (each bucket its leading rows), filled as padding.
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), pad_block * block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (size, max_blocks_per_seq), pad_block, dtype=torch.int32, device=device
        )
        self.context_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.rows = torch.arange(size, dtype=torch.int32, device=device)  # the flat batch is the sequences
        self.logit_rows = torch.arange(size, dtype=torch.long, device=device)
        self.backend = TritonPagedBackend()
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_error: str | None = None  # why graphs were turned off, if a capture failed

    def run(self, batch: Batch) -> torch.Tensor | None:
        """(num_seqs, vocab_size) float32 logits of a graph step; None when the step is not one (is_graph_step,
        or wider than the largest bucket): the caller runs it eagerly."""
        bucket = bucket_for(batch.num_seqs, self.buckets) if is_graph_step(batch) else None
        tables = batch.block_table_tensor()
        if bucket is None or tables.shape[1] > self.block_tables.shape[1] or self.capture_error is not None:
            return None
        if bucket not in self.replays and not self._capture(bucket):
            return None
        padded = padded_decode_inputs(
            batch.token_ids, batch.num_computed_tokens, tables, self.block_size, bucket, self.pad_block
        )
        self._fill(padded)
        return self.replays[bucket]()[: batch.num_seqs]

    def _capture(self, bucket: int) -> bool:
        """Capture the bucket's graph; False (and graphs off from then on, said once in the log) if capturing
        fails: a step the graph cannot record still runs eagerly, and the server goes on serving."""
        # Captured over padding only: the capture's own runs write K/V, and rows left from an earlier step of a
        # wider bucket would write theirs into blocks that may have changed hands since.
        self._fill_padding(bucket)
        try:
            self.replays[bucket] = self.capture(self._forward(bucket))
        except RuntimeError as e:
            self.capture_error = f"bucket {bucket}: {e}"
            logger.warning("decode graphs are off, every step runs eagerly: capturing %s", self.capture_error)
            self._fill_padding(bucket)  # the failed runs may have left nothing else behind
            return False
        return True

    def _fill_padding(self, bucket: int) -> None:
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(self.pad_block * self.block_size)
        self.block_tables[:bucket].fill_(self.pad_block)
        self.context_lens[:bucket].fill_(1)

    def _fill(self, padded: PaddedDecode) -> None:
        bucket, width = padded.block_tables.shape
        # NOTE: columns past this step's widest table keep older ids: no kernel reads past a context.
        for static, values in (
            (self.input_ids[:bucket], padded.input_ids),
            (self.positions[:bucket], padded.positions),
            (self.slot_mapping[:bucket], padded.slot_mapping),
            (self.block_tables[:bucket, :width], padded.block_tables),
            (self.context_lens[:bucket], padded.context_lens),
        ):
            static.copy_(values, non_blocking=True)

    def _forward(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The bucket's forward over the static buffers' leading rows: what capture() records."""
        decodes = TritonDecodes(self.rows[:bucket], self.block_tables[:bucket], self.context_lens[:bucket])
        metadata = TritonMetadata(self.slot_mapping[:bucket], self.block_size, decodes, None)
        step = StepAttention(self.backend, metadata)
        input_ids, positions, logit_rows = (
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.logit_rows[:bucket],
        )

        def run() -> torch.Tensor:  # (bucket, vocab_size) float32
            return self.model(input_ids, positions, self.kv_caches, step, logit_rows)

        return run
