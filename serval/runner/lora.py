"""LoRA in the runner: reading PEFT adapters, the preallocated adapter slots, and the batched LoRA matmul.

Owns adapter weights. When LoRA is enabled, every Linear an adapter may target gets a LoraTarget holding the
A and B matrices of all `max_loras` slots stacked in two tensors, so loading an adapter is a copy into its
slot and nothing is allocated at run time. Per step, a LoraBatch says which token rows use which slot, and
each LoraTarget adds `x @ A_s^T @ (scaling * B_s)^T` to the rows of every slot s in the batch: base requests
and requests for different adapters run in one forward pass. A step without adapter tokens has no LoraBatch
and skips all of this.

Adapters name their targets as Hugging Face modules (`layers.3.self_attn.q_proj`); the model's `lora_layout`
maps them onto our fused q/k/v and gate/up matrices, whose shards share one LoraTarget.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# adapter_config.json options that change what the adapter computes beyond W + scaling * B @ A; an adapter
# that sets any of them would silently compute something else here, so it is refused.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "lora_bias": "lora_bias",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "target_parameters",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
}

# PEFT's tensor names: base_model.model.model.layers.{i}.{module}.lora_{A,B}.weight
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


@dataclass
class LoraAdapter:
    """A PEFT adapter read from disk and checked against the model, ready to be copied into a slot."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r (or / sqrt(r) with use_rslora); already folded into the B matrices
    # (layer index, Hugging Face module suffix such as "self_attn.q_proj") ->
    # (A (rank, in_features), scaling * B (out_features, rank)), in the model's dtype and on its device
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


# Up to this many tokens in a step, a group's rows are picked by a 0/1 mask applied after the shrink matmul
# instead of a gather before and a scatter after: at decode sizes that is about a third cheaper per
# projection (CPU, 8 rows: 49 against 70 us in bf16). On a long prefill chunk the mask would repeat every
# group's matmuls over all rows, so there the gather wins.
MAX_MASKED_TOKENS = 64


@dataclass
class LoraGroup:
    """The rows of one step that use one adapter slot. With neither rows nor mask: every row."""

    slot: int
    rows: torch.Tensor | None = None  # (num_rows,) int64 indices into the step's tokens (long steps)
    mask: torch.Tensor | None = (
        None  # (num_tokens, 1) 1 on its rows, 0 elsewhere, compute dtype (short steps)
    )


@dataclass
class LoraBatch:
    """Which of one step's token rows use which adapter slot; built once per step, read by every target."""

    groups: list[LoraGroup]  # one per slot present in the step

    @classmethod
    def build(
        cls, slots: list[int], num_new_tokens: list[int], dtype: torch.dtype, device: torch.device
    ) -> LoraBatch | None:
        """slots: per sequence, its adapter slot or -1 for the base model. None when no adapter is used."""
        present = sorted({slot for slot in slots if slot >= 0})
        if not present:
            return None
        if len(set(slots)) == 1:
            return cls([LoraGroup(present[0])])  # one adapter for every row: nothing to pick
        token_slots = torch.tensor(slots).repeat_interleave(torch.tensor(num_new_tokens))  # (num_tokens,)
        groups = []
        for slot in present:
            is_slot = token_slots == slot
            if len(token_slots) <= MAX_MASKED_TOKENS:
                groups.append(LoraGroup(slot, mask=is_slot.unsqueeze(1).to(device=device, dtype=dtype)))
            else:
                groups.append(LoraGroup(slot, rows=is_slot.nonzero().squeeze(1).to(device)))
        return cls(groups)


class LoraTarget:
    """The adapter slots of one Linear, whose output rows may be several Hugging Face modules (shards).

    Per slot, the A matrices of the shards an adapter targets are stacked (rank rows each), and the B
    matrices, transposed and scaled, sit in the same rows at their shards' output columns: one shrink and
    one expand matmul cover a fused q/k/v. NOTE: for a fused matrix that expand multiplies zeros outside each
    shard's columns; with ranks far below the hidden size that waste is small next to the base matmul.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        shards: list[tuple[str, int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        dense_kernel=None,
    ):
        dense = dense_kernel is not None
        self.shards = shards  # (Hugging Face module suffix, first output column, columns), in output order
        width = len(shards) * max_rank
        # (max_loras, width, in_features): A; (max_loras, width, out_features): (scaling * B)^T
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        # kernels.dense_linear (LoraSlots sets it with the native kernels): then both products go through it,
        # a row's delta the same bits whatever else is in the step; it takes B as (max_loras, out_features,
        # width), scaling * B itself. Unused rows of A and columns of B are zeros, which add nothing.
        self.dense_kernel = dense_kernel
        self.b = torch.zeros(max_loras, out_features, width, dtype=dtype, device=device) if dense else None
        # Per slot, the rows of a[slot] and bt[slot] in use as (width, in) and (width, out) views, or None
        # where the slot leaves this Linear alone. NOTE: kept rather than sliced per call: slicing the 3-d
        # stacks costs about a third of the whole delta at decode sizes.
        self.slot_weights: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        """y (num_tokens, out_features) += the LoRA delta of each row's slot; x (num_tokens, in_features)."""
        if self.dense_kernel is not None:
            self._add_invariant_delta(y, x, batch)
            return
        for group in batch.groups:
            weights = self.slot_weights[group.slot]
            if weights is None:
                continue
            a, bt = weights  # (width, in_features), (width, out_features)
            if group.rows is not None:
                y.index_add_(0, group.rows, (x.index_select(0, group.rows) @ a.t()) @ bt)
            elif group.mask is not None:
                y.addmm_((x @ a.t()).mul_(group.mask), bt)
            else:
                y.addmm_(x @ a.t(), bt)

    def _add_invariant_delta(self, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        # Each row's delta is computed from that row alone and added once, in all three group forms.
        matmul = self.dense_kernel
        for group in batch.groups:
            if self.slot_weights[group.slot] is None:
                continue
            a, b = self.a[group.slot], self.b[group.slot]  # (width, in_features), (out_features, width)
            if group.rows is not None:
                y.index_add_(0, group.rows, matmul(matmul(x.index_select(0, group.rows), a), b))
            elif group.mask is not None:
                y.add_(matmul(matmul(x, a).mul_(group.mask), b))
            else:
                y.add_(matmul(matmul(x, a), b))

    def load(self, slot: int, shard_weights: list[tuple[torch.Tensor, torch.Tensor] | None], rank: int):
        """Copy one adapter into `slot`: per shard its (A, scaled B), or None where it leaves the shard."""
        self.clear(slot)
        row = 0
        for (_, start, size), weights in zip(self.shards, shard_weights):
            if weights is None:
                continue
            a, b = weights
            self.a[slot, row : row + rank].copy_(a)
            self.bt[slot, row : row + rank, start : start + size].copy_(b.t())
            if self.b is not None:
                self.b[slot, start : start + size, row : row + rank].copy_(b)
            row += rank
        if row:
            self.slot_weights[slot] = (self.a[slot, :row], self.bt[slot, :row])

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        if self.b is not None:
            self.b[slot].zero_()
        self.slot_weights[slot] = None


class LoraSlots:
    """Every LoraTarget of a model, and the adapter slots across them.

    The model provides `lora_layout()`: Hugging Face module suffix -> (its Linear in a decoder layer, first
    output row, rows). Each Linear named there gets a LoraTarget as its `lora_target`.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dense_kernel=None):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layout: dict[str, tuple[str, int, int]] = model.lora_layout()
        self.num_layers = len(model.layers)
        weight = model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.targets: list[tuple[int, LoraTarget]] = []  # (layer index, target)
        self.in_features: dict[str, int] = {}  # Hugging Face module suffix -> its input width
        for linear_name in sorted({name for name, _, _ in self.layout.values()}):
            shards = sorted(
                ((suffix, start, size) for suffix, (name, start, size) in self.layout.items()
                 if name == linear_name),
                key=lambda shard: shard[1],
            )  # fmt: skip
            for layer_index, layer in enumerate(model.layers):
                linear = layer.get_submodule(linear_name)
                target = LoraTarget(
                    linear.in_features,
                    linear.out_features,
                    shards,
                    max_loras,
                    max_rank,
                    self.dtype,
                    self.device,
                    dense_kernel,
                )
                linear.lora_target = target
                self.targets.append((layer_index, target))
            for suffix, _, _ in shards:
                self.in_features[suffix] = linear.in_features

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        for layer_index, target in self.targets:
            shard_weights = [adapter.weights.get((layer_index, suffix)) for suffix, _, _ in target.shards]
            target.load(slot, shard_weights, adapter.rank)

    def unload(self, slot: int) -> None:
        for _, target in self.targets:
            target.clear(slot)

    def read(self, path: str) -> LoraAdapter:
        """Read and check a PEFT adapter directory; ValueError naming what is wrong. Touches no slot."""
        rank, scaling = read_adapter_config(path)
        if rank > self.max_rank:
            raise ValueError(
                f"the adapter at {path} has rank {rank}, more than --max-lora-rank {self.max_rank}"
            )
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in _iter_tensors(path):
            match = _TENSOR_NAME.match(name)
            if match is None or match[2] not in self.layout:
                if ".lora_" not in name:
                    raise ValueError(f"the adapter at {path} has a tensor {name!r} that is not a LoRA matrix")
                module = name.partition(".lora_")[0].removeprefix("base_model.model.")
                raise ValueError(
                    f"the adapter at {path} targets {module!r}, which is not supported (supported: "
                    f"{', '.join(sorted(self.layout))} of the decoder layers)"
                )
            layer_index, suffix, which = int(match[1]), match[2], match[3]
            if layer_index >= self.num_layers:
                raise ValueError(f"the adapter at {path} targets layer {layer_index}; the model has "
                                 f"{self.num_layers}")  # fmt: skip
            pairs.setdefault((layer_index, suffix), {})[which] = tensor
        if not pairs:
            raise ValueError(f"the adapter at {path} holds no LoRA weights")
        weights = {}
        for (layer_index, suffix), pair in pairs.items():
            where = f"layers.{layer_index}.{suffix}"
            if set(pair) != {"A", "B"}:
                raise ValueError(f"the adapter at {path} has lora_A or lora_B of {where} but not both")
            a, b = pair["A"], pair["B"]
            out_rows = self.layout[suffix][2]
            if tuple(a.shape) != (rank, self.in_features[suffix]) or tuple(b.shape) != (out_rows, rank):
                raise ValueError(
                    f"the adapter at {path} does not fit this model: {where} has lora_A "
                    f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                    f"{(rank, self.in_features[suffix])} and {(out_rows, rank)}"
                )
            # Scaled in fp32 before the cast, as PEFT computes it.
            weights[(layer_index, suffix)] = (
                a.to(device=self.device, dtype=self.dtype),
                (b.float() * scaling).to(device=self.device, dtype=self.dtype),
            )
        return LoraAdapter(path=path, rank=rank, scaling=scaling, weights=weights)


def read_adapter_config(path: str) -> tuple[int, float]:
    """(rank, scaling) from a PEFT adapter_config.json; ValueError for what this runner can't apply."""
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a PEFT adapter: it has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object")  # noqa: TRY004 - a bad file is a ValueError
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"the adapter at {path} is {peft_type}; only LORA adapters are supported")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"the adapter at {path} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"the adapter at {path} trains biases (bias={config['bias']!r}), which is not supported"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")  # noqa: TRY004
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _iter_tensors(path: str):
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(
            f"the adapter at {path} has no {WEIGHTS_FILE} (only safetensors adapters are supported)"
        )
    try:
        with safe_open(weights_path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                yield name, f.get_tensor(name)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read {weights_path}: {e}") from None
