"""Packing a model's matrices while its checkpoint streams in (the forms themselves: runner/quantization.py).

`LowBitPacker` follows the load one tensor at a time: it collects each matrix's packed form (built by the
GGUF reader from the file's blocks, or recognized in the fp32 values of other checkpoints), joins the shards
of fused matrices (q/k/v, gate/up), frees dense copies nobody needs, and finally attaches the forms to the
model's Linear layers. With `plan_packed_only` the dense copies of a block-quantized file are never made at
all: the reader skips dequantizing them, so a load holds no more than the packed model plus one tensor. With
`plan_joined` the shards of a fused matrix stored in one block type are packed by the reader straight into
the matrix's one set of buffers, so there is nothing to join.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from serval.runner.layers import Linear
from serval.runner.quantization import (
    GROUP,
    PackedParts,
    PackedWeight,
    concatenated,
    dense_placeholder,
    find_packed,
)


class LowBitPacker:
    """`offer` each (Hugging Face name, fp32 tensor) as it streams; `attach` then gives every Linear its packed
    form (`module.packed`; a fused matrix's is its shards' forms joined) and a tied embedding used as the head
    `model.packed_tied_head`. Only fp32 values show whether a matrix of a non-GGUF checkpoint is exactly
    4/8-bit blocks, and the model is built in its compute dtype, so this happens one tensor at a time.
    """

    def __init__(self, model: nn.Module, release_dense: bool = False, from_file: dict | None = None):
        """release_dense: free a matrix's dense copy as soon as all its shards are loaded and packed (the
        packed kernels serve every batch size): the load never holds a dense copy of a quantized file.
        from_file: packed forms the reader built from the file's blocks, by Hugging Face name (filled as
        the checkpoint streams): used as they are, instead of recognizing them in the fp32 values."""
        self.model = model
        self.release_dense = release_dense
        self.from_file = {} if from_file is None else from_file
        # parameter -> shard -> form, until all its shards are in
        self.shards: dict[str, dict[int, PackedWeight | None]] = {}
        # parameter -> its (joined) form, or None
        self.complete: dict[str, PackedWeight | PackedParts | None] = {}
        self.releasable: list[str] = []  # complete and packed, dense copy not yet released
        self.packed_only: set[str] = set()  # parameters never materialized densely (plan_packed_only)
        # fused parameter -> the one block type of its shards (plan_joined)
        self.joinable: dict[str, int] = {}
        # fused parameter -> its packed buffers, while its shards fill them (join_target)
        self.joined: dict[str, PackedWeight] = {}
        self._empty: Callable[[int, int, int], PackedWeight] | None = None

    def plan_packed_only(self, packable_names: frozenset[str]) -> frozenset[str]:
        """Before the checkpoint streams, with the names of the matrices the reader packs from the file: each
        parameter all of whose shards are among them (and whose dense copy would be released anyway) gets
        its placeholder now. Returns those tensors' names, for the reader to yield as shapes only."""
        if not self.release_dense:
            return frozenset()
        shards_of: dict[str, list[str]] = {}
        for name in packable_names:
            target = self.model.weight_target(name)
            if target is not None:
                shards_of.setdefault(target[0], []).append(name)
        names: set[str] = set()
        for parameter, shard_names in shards_of.items():
            if len(shard_names) != self.model.num_shards(parameter) or not self._looks_up_packed(parameter):
                continue
            # Shards are joined by whole groups of 16 rows (quantization.concatenated): check it now, since
            # a parameter planned here has no dense copy to fall back on.
            shard_rows = [self.model.shard_range(parameter, i)[1] for i in range(len(shard_names))]
            if len(shard_names) > 1 and any(rows % GROUP for rows in shard_rows[:-1]):
                continue
            module_name, attribute = parameter.rsplit(".", 1)
            module = self.model.get_submodule(module_name)
            setattr(module, attribute, dense_placeholder(getattr(module, attribute), device="cpu"))
            self.packed_only.add(parameter)
            names.update(shard_names)
        return frozenset(names)

    def plan_joined(
        self, block_types: Mapping[str, int], empty: Callable[[int, int, int], PackedWeight]
    ) -> None:
        """Before the checkpoint streams, with the block type of each matrix stored in one: a fused matrix
        (q/k/v, gate/up) whose shards all share one type, and start on whole groups of 16 rows, gets one set
        of packed buffers (`empty(type, rows, cols)`, made at its first shard) that the reader packs each
        shard into (join_target). Packing each alone and joining them after costs a second copy, in fresh
        memory advised for huge pages (~0.3 s of a 1B model's start-up)."""
        shards_of: dict[str, list[int]] = {}
        for name, block_type in block_types.items():
            target = self.model.weight_target(name)
            if target is not None and target[1] is not None:
                shards_of.setdefault(target[0], []).append(block_type)
        for parameter, types in shards_of.items():
            count = self.model.num_shards(parameter)
            starts = [self.model.shard_range(parameter, i)[0] for i in range(count)]
            if len(types) == count and len(set(types)) == 1 and not any(start % GROUP for start in starts):
                self.joinable[parameter] = types[0]
        self._empty = empty

    def join_target(self, hf_name: str, cols: int) -> tuple[PackedWeight, int] | None:
        """Where the reader packs shard `hf_name`: its fused matrix's buffers and its first group of rows in
        them; None for a matrix packed alone."""
        target = self.model.weight_target(hf_name)
        if target is None or target[0] not in self.joinable or self._empty is None:
            return None
        parameter, shard = target
        joined = self.joined.get(parameter)
        if joined is None:
            last_start, last_rows = self.model.shard_range(parameter, self.model.num_shards(parameter) - 1)
            joined = self.joined[parameter] = self._empty(
                self.joinable[parameter], last_start + last_rows, cols
            )
        return joined, self.model.shard_range(parameter, shard or 0)[0] // GROUP

    def offer(self, hf_name: str, tensor: torch.Tensor) -> None:
        target = self.model.weight_target(hf_name)
        known = self.from_file.pop(hf_name, None)
        if target is None or tensor.dim() != 2:
            return
        parameter, shard = target
        shards = self.shards.setdefault(parameter, {})
        if known is not None and known.bits == 16 and not self.release_dense:
            # Beside a dense copy in the compute dtype (the bf16 path) a 16-bit form is a second full copy
            # for no speed: the bf16 kernels already read 2 bytes a weight.
            shards[shard or 0] = None
        else:
            shards[shard or 0] = known if known is not None else find_packed(tensor)
        if len(shards) == self.model.num_shards(parameter):
            if parameter in self.joined:  # every shard was packed into these buffers (join_target)
                packed = self.joined.pop(parameter)
                if any(form is not packed for form in shards.values()):
                    raise RuntimeError(f"{parameter}: a shard was not packed into the fused matrix")
            else:
                packed = concatenated([shards[i] for i in sorted(shards)])
            self.complete[parameter] = packed
            del self.shards[parameter]
            if parameter in self.packed_only:
                if packed is None:  # the reader packs every tensor it was told to skip
                    raise RuntimeError(
                        f"{parameter}: planned packed-only, but its shards have no packed form"
                    )
            elif self.release_dense and self._looks_up_packed(parameter) and packed is not None:
                self.releasable.append(parameter)

    def release_completed(self) -> None:
        """Give every parameter whose shards have all been loaded, and packed, a placeholder for its dense
        weight (call once the loader has copied the tensors offered so far)."""
        for parameter in self.releasable:
            module_name, attribute = parameter.rsplit(".", 1)
            module = self.model.get_submodule(module_name)
            setattr(module, attribute, dense_placeholder(getattr(module, attribute)))
        self.releasable.clear()

    def attach(self) -> None:
        for name, module in self.model.named_modules():
            if isinstance(module, Linear):
                module.packed = self.complete.get(f"{name}.weight")
        embedding = self.complete.get("embed_tokens.weight")
        if hasattr(self.model, "packed_tied_head") and getattr(self.model, "lm_head", None) is None:
            self.model.packed_tied_head = embedding
        if self.release_dense and hasattr(self.model, "packed_embedding"):
            # Its dense copy was released: look-ups dequantize rows of the packed form.
            self.model.packed_embedding = embedding
        self.complete.clear()

    def _looks_up_packed(self, parameter: str) -> bool:
        # The embedding's dense copy may go only where the model can look rows up in the packed form.
        return parameter != "embed_tokens.weight" or hasattr(self.model, "packed_embedding")
