"""The attention backend interface: what a backend is given of a step, and what the model code calls.

A backend turns the step's layout (which sequences, how many new tokens each, which KV blocks) into its own
metadata once per step, then runs every layer's attention over the paged cache from it. The model code calls
`paged_attention(...)` with the step's `StepAttention` and knows no backend; the runner picks the backend
once, at start-up (selector.py).

The cache of one layer is two flat tensors of slots, (num_blocks * block_size, num_kv_heads, head_dim);
slot = block_id * block_size + offset. A step's tokens are flattened into one varlen batch, each sequence's
new tokens consecutive, in the layout's order.

A model with multi-head latent attention (DeepSeek's MLA, runner/mla.py) caches one vector a token instead: its
layer's cache is ONE such tensor with a single "kv head" of the latent's size, and `paged_latent_attention`
attends over it as multi-query attention whose value is the first `value_dim` values of each key row. What a
model's layer caches is its KvCacheSpec, which the runner reads to allocate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from serval.runner.attention.cache_dtype import store_rows


@dataclass(frozen=True)
class StepLayout:
    """The shape of one step as every backend reads it: built once by the runner, from its batch state."""

    num_new_tokens: list[int]  # per sequence
    num_computed_tokens: list[int]  # per sequence: tokens already cached (its first new token's position)
    # (num_seqs, max_blocks) int64 on the CPU: each sequence's blocks in order; entries past them are never
    # read (they may hold any valid block id)
    block_tables: torch.Tensor
    block_size: int
    device: torch.device

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes one token (the common step, which backends may build faster)."""
        return all(n == 1 for n in self.num_new_tokens)

    # The counts as CPU int64 tensors, made once however many of the step's builders read them.
    @functools.cached_property
    def new_counts(self) -> torch.Tensor:
        return torch.tensor(self.num_new_tokens, dtype=torch.long)

    @functools.cached_property
    def computed_counts(self) -> torch.Tensor:
        return torch.tensor(self.num_computed_tokens, dtype=torch.long)

    @functools.cached_property
    def context_lens(self) -> torch.Tensor:
        """(num_seqs,) cached + new tokens."""
        return self.new_counts + self.computed_counts


@dataclass(frozen=True)
class KvCacheSpec:
    """What one layer's paged cache holds a token: the model says (its class's kv_cache_spec(arch)), the runner
    allocates. A latent cache is one tensor, serving as both K and V of the layer's (k_cache, v_cache) pair."""

    num_kv_heads: int
    head_dim: int  # of each cached key row
    # MLA: the value is the first value_dim values of the key row, and no V tensor is kept; 0: a V row of
    # head_dim values beside each K row (every other model)
    latent_value_dim: int = 0

    @property
    def is_latent(self) -> bool:
        return self.latent_value_dim > 0

    def values_per_token(self) -> int:
        """Cache elements one token takes in one layer."""
        return (1 if self.is_latent else 2) * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class FusedDecodeInputs:
    """A decode-only step's cache addressing, for a whole-model native decode (models/decode_stack.py)."""

    slot_mapping: torch.Tensor  # (num_seqs,) where each new token's K/V goes
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int64
    context_lens: torch.Tensor  # (num_seqs,) int64, the new token included


class AttentionBackend(Protocol):
    name: str  # RunnerInfo.attention_backend: in /version and the serval_model_info gauge's labels

    def build(self, layout: StepLayout) -> object:
        """The backend's own metadata for the step: everything the layers reuse, built once."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim), RoPE applied
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), RoPE applied
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
        v_cache: torch.Tensor,
        metadata: object,  # what build() returned for this step
        scale: float,
        window: int,  # a query sees the last `window` positions up to its own; 0: its whole context
        sinks: torch.Tensor | None,  # (num_heads,) fp32 sink logits added to every softmax's denominator
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim); the new K/V written to their slots
        ...

    def forward_latent(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim): [query in latent space, roped part]
        latent: torch.Tensor,  # (num_tokens, 1, head_dim): each new token's cache row, [c_kv, roped k]
        cache: torch.Tensor,  # (num_slots, 1, head_dim): the layer's one latent cache
        metadata: object,
        scale: float,
        value_dim: int,  # a key row's first value_dim values are its value
    ) -> torch.Tensor:  # (num_tokens, num_heads, value_dim); the new rows written to their slots
        """Multi-query attention over a latent cache (MLA's absorbed form): the same tiles and orders as forward."""
        ...

    def fused_decode_inputs(self, metadata: object) -> FusedDecodeInputs | None:
        """The cache addressing a fused native decode reads, when the step is decode-only and this backend's
        cache layout is the one it reads in place; None otherwise (the model then runs layer by layer)."""
        ...


@dataclass(frozen=True)
class StepAttention:
    """One step's attention: the backend and the metadata it built. The model passes it to every layer."""

    backend: AttentionBackend
    metadata: object

    @classmethod
    def build(cls, backend: AttentionBackend, layout: StepLayout) -> StepAttention:
        return cls(backend, backend.build(layout))

    @property
    def fused_decode(self) -> FusedDecodeInputs | None:
        return self.backend.fused_decode_inputs(self.metadata)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepAttention,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one call the model code makes: the step's backend's attention (AttentionBackend.forward)."""
    return step.backend.forward(q, k, v, k_cache, v_cache, step.metadata, scale, window, sinks)


def paged_latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    cache: torch.Tensor,
    step: StepAttention,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """MLA's call: the step's backend's latent attention (AttentionBackend.forward_latent)."""
    return step.backend.forward_latent(q, latent, cache, step.metadata, scale, value_dim)


def write_new_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The step's new K/V rows into their cache slots (every backend over the flat slot layout does this first)."""
    store_rows(k, k_cache, slot_mapping)
    store_rows(v, v_cache, slot_mapping)


def padded_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """(num_seqs, max_blocks) int64 block ids from lists, each row padded with 0 (for callers without a
    persistent batch state: tests, embeddings)."""
    max_blocks = max(len(table) for table in block_tables)
    return torch.tensor([table + [0] * (max_blocks - len(table)) for table in block_tables], dtype=torch.long)


def context_slots(layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Every context position of every sequence as a cache slot, (num_seqs, max_context_len) with padding at
    slot 0, and which positions are in a sequence's context."""
    tables, block_size = layout.block_tables, layout.block_size
    context = layout.context_lens
    num_seqs, max_blocks = tables.shape
    max_context = int(context.max())
    positions = torch.arange(max_context).expand(num_seqs, max_context)
    in_context = positions < context[:, None]
    slots = tables.gather(1, (positions // block_size).clamp(max=max_blocks - 1)) * block_size
    return torch.where(in_context, slots + positions % block_size, 0), in_context


def new_token_slots(layout: StepLayout, slots: torch.Tensor, in_context: torch.Tensor) -> torch.Tensor:
    """(num_tokens,) the slot of each new token, sequence by sequence in order (from context_slots)."""
    positions = torch.arange(slots.shape[1])
    return slots[in_context & (positions >= layout.computed_counts[:, None])]
