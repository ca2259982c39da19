"""Which slice of a Llama-family model one tensor-parallel rank holds, and cutting weights down to it.

Owns the split (Megatron's): q/k/v and gate/up are column-parallel (each rank keeps the output rows of its
heads and of its slice of the MLP's intermediate width), o_proj and down_proj are row-parallel (each rank keeps
the matching input columns, and the ranks' partial outputs are summed by one all-reduce per block half).
Norms, the embedding and the head are whole on every rank. A rank's model is the same LlamaForCausalLM built
from a smaller ArchConfig (its heads, KV heads and intermediate width), so everything below the loader runs
unchanged; `sharded_checkpoint` cuts each tensor as the checkpoint streams in, packed GGUF blocks included
(along whole blocks: runner/quantization.py), so a rank never holds more than its slice plus one tensor.

Heads are split by whole KV groups: rank r gets a contiguous run of KV heads and the query heads that read
them. NOTE: not necessarily evenly. The default model (SmolLM2-135M) has 9 query and 3 KV heads, so on 2
ranks one holds 2 KV groups and the other 1; refusing every count that does not divide would refuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serval.runner.loader.load import Checkpoint, WeightsReader
from serval.runner.models.arch import ArchConfig
from serval.runner.quantization import GROUP, PackedWeight

# The architectures whose decoder (runner/models/llama.py) knows how to all-reduce its block halves.
SHARDABLE_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)


@dataclass(frozen=True)
class TensorParallelPart:
    """What makes a ModelRunner one rank of a split model (parallel/runner.py and worker.py fill it)."""

    rank: int
    world_size: int
    all_reduce: Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


@dataclass(frozen=True)
class TensorShard:
    """One rank's part of the model: [start, end) ranges in the full model's numbering."""

    rank: int
    world_size: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]  # query heads: the KV heads' groups
    intermediate: tuple[int, int]  # rows of gate/up, columns of down_proj
    head_dim: int

    @property
    def q_rows(self) -> tuple[int, int]:
        return self.heads[0] * self.head_dim, self.heads[1] * self.head_dim

    @property
    def kv_rows(self) -> tuple[int, int]:
        return self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim

    def arch(self, full: ArchConfig) -> ArchConfig:
        """The shape of this rank's model: hidden size and vocabulary whole, heads and MLP width its own."""
        return dataclasses.replace(
            full,
            num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
        )

    def cut(self, hf_name: str) -> tuple[int, int, int] | None:
        """How a checkpoint tensor is cut for this rank: (dim, start, end), dim 0 rows / 1 columns; None: whole."""
        name = hf_name.removeprefix("model.")
        if not name.startswith("layers."):
            return None
        for suffix, dim, span in (
            ("self_attn.q_proj.", 0, self.q_rows),
            ("self_attn.k_proj.", 0, self.kv_rows),
            ("self_attn.v_proj.", 0, self.kv_rows),
            ("self_attn.o_proj.weight", 1, self.q_rows),
            ("mlp.gate_proj.", 0, self.intermediate),
            ("mlp.up_proj.", 0, self.intermediate),
            ("mlp.down_proj.weight", 1, self.intermediate),
        ):
            if suffix in name:
                return dim, *span
        return None


def plan_shard(arch: ArchConfig, rank: int, world_size: int) -> TensorShard:
    """Rank `rank`'s part of `arch` split `world_size` ways; ValueError, saying why, when it cannot be split."""
    if arch.architecture not in SHARDABLE_ARCHITECTURES:
        raise ValueError(
            f"tensor parallelism runs the Llama-family text decoders ({', '.join(sorted(SHARDABLE_ARCHITECTURES))}),"
            f" not {arch.architecture}"
        )
    if arch.num_kv_heads < world_size:
        raise ValueError(
            f"{arch.architecture} has {arch.num_kv_heads} KV heads: tensor parallelism gives every rank whole KV "
            f"heads, so its size can be at most {arch.num_kv_heads}, not {world_size}"
        )
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"{arch.num_heads} query heads do not form groups over {arch.num_kv_heads} KV heads")
    if arch.intermediate_size % world_size:
        raise ValueError(
            f"the MLP's intermediate size {arch.intermediate_size} does not divide by the tensor-parallel size "
            f"{world_size}"
        )
    kv_start, kv_end = balanced_range(arch.num_kv_heads, rank, world_size)
    group = arch.num_heads // arch.num_kv_heads
    width = arch.intermediate_size // world_size
    return TensorShard(
        rank=rank,
        world_size=world_size,
        kv_heads=(kv_start, kv_end),
        heads=(kv_start * group, kv_end * group),
        intermediate=(rank * width, (rank + 1) * width),
        head_dim=arch.head_dim,
    )


def balanced_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of `total` items split as evenly as can be; the first ranks take one more."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def sharded_checkpoint(checkpoint: Checkpoint, shard: TensorShard) -> Checkpoint:
    """The same checkpoint as one rank sees it: its ArchConfig, and a reader that yields each tensor (and its
    packed form, when the reader builds one) cut to the rank's slice."""
    read_full = checkpoint.read_weights

    def read(packed_forms: dict | None = None, packed_only=frozenset(), repack=None):
        # The reader fills `full_forms` with each tensor's packed form before it yields the tensor.
        full_forms = None if packed_forms is None else {}
        # Each shard's form is cut from its whole matrix here, so none is packed into a fused one's buffers.
        whole_repack = None if repack is None else dataclasses.replace(repack, join_target=None)
        for name, tensor in read_full(full_forms, packed_only, whole_repack):
            cut = shard.cut(name)
            if full_forms is not None and name in full_forms:
                packed_forms[name] = cut_packed(full_forms.pop(name), cut, name)
            yield name, cut_dense(tensor, cut)

    reader: WeightsReader = read
    return dataclasses.replace(checkpoint, arch=shard.arch(checkpoint.arch), read_weights=reader)


def cut_dense(tensor: torch.Tensor, cut: tuple[int, int, int] | None) -> torch.Tensor:
    if cut is None:
        return tensor
    dim, start, end = cut
    if dim >= tensor.dim():  # a bias of a row-parallel matrix would be summed N times: none exists here
        raise ValueError(f"cannot cut a {tensor.dim()}-D tensor along dimension {dim}")
    # NOTE: a copy, not a view: the loader keeps what it is given, and a view would pin the whole tensor.
    return (
        tensor.narrow(dim, start, end - start).clone()
        if not tensor.is_meta
        else tensor.narrow(dim, start, end - start)
    )


def cut_packed(form: PackedWeight, cut: tuple[int, int, int] | None, name: str) -> PackedWeight:
    """A packed matrix's rows or columns [start, end), exactly: whole groups of 16 rows, whole blocks of
    columns (32 weights, or a k-quant's 256). ValueError naming the matrix when the slice splits a block."""
    if cut is None:
        return form
    dim, start, end = cut
    if form.bits == 16:  # the file's own fp16/bf16 values
        codes = form.codes.narrow(dim, start, end - start).contiguous()
        return PackedWeight(16, codes.shape[0], codes, form.scales)
    if dim == 0:
        if start % GROUP or (end % GROUP and end != form.out_features):
            raise ValueError(
                f"{name}: packed rows come in groups of {GROUP}, so its tensor-parallel slice [{start}, {end})"
                " cannot be cut from it; try another --tensor-parallel-size"
            )
        first, last = start // GROUP, -(-end // GROUP)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t[first:last].contiguous() if t.numel() else t

        return PackedWeight(
            form.bits,
            end - start,
            rows(form.codes),
            rows(form.scales),
            rows(form.offsets),
            rows(form.super_scales),
        )
    in_features = form.codes.shape[1] * 32

    def columns(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t
        per_entry = in_features // t.shape[1]  # weights one entry of dim 1 covers: 32, 16 or 256
        if start % per_entry or end % per_entry:
            raise ValueError(
                f"{name}: its format stores blocks of {per_entry} weights along the input, so its "
                f"tensor-parallel slice of columns [{start}, {end}) would split a block; try another "
                "--tensor-parallel-size (or a checkpoint in another format)"
            )
        return t[:, start // per_entry : end // per_entry].contiguous()

    return PackedWeight(
        form.bits,
        form.out_features,
        columns(form.codes),
        columns(form.scales),
        columns(form.offsets),
        columns(form.super_scales),
    )
