"""Turn a ModelSource into a ready model: architecture config, model class, weights, dtype and device."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from serval.model_source import ModelSource
from serval.runner.layers import Linear
from serval.runner.loader.mxfp4_experts import has_mxfp4_experts, iter_mxfp4_checkpoint, mxfp4_expert_types
from serval.runner.loader.packer import LowBitPacker
from serval.runner.loader.safetensors import iter_safetensors_weights, read_hf_config, safetensors_formats
from serval.runner.models.arch import ArchConfig
from serval.runner.models.registry import model_class
from serval.runner.pooling import read_pooling

if TYPE_CHECKING:
    from serval.runner.loader.gguf_pack import NativeRepack

# Streams the weights with Hugging Face names; given a dict, a reader that can also fills it with the packed
# forms (runner/quantization.py) it builds from the file's own blocks (with the native `repack` kernel when
# given), each before its tensor, and yields the names in `packed_only` as meta tensors (shape only) instead
# of dequantizing them.
WeightsReader = Callable[..., Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True)
class Checkpoint:
    arch: ArchConfig
    read_weights: WeightsReader  # streams the weights with Hugging Face names
    # The stored weight formats of its matrices, most weights first: GGUF types ("Q4_1", "Q8_0", "F16") or
    # safetensors dtypes ("BF16"); 1-D tensors (norms, biases) are not counted.
    weight_formats: tuple[str, ...]
    # The Hugging Face names of the matrices the reader packs from the file's own bytes (GGUF block types,
    # kept as codes and scales; F16/BF16, kept as they are: runner/quantization.py).
    packable_names: frozenset[str] = frozenset()
    # The GGML block type of each matrix stored in one (GGUF files): fused matrices whose shards share one
    # are packed straight into one set of buffers (LowBitPacker.plan_joined).
    block_types: Mapping[str, int] = field(default_factory=dict)

    @property
    def has_packable_weights(self) -> bool:
        return bool(self.packable_names)


def open_checkpoint(source: ModelSource) -> Checkpoint:
    """The checkpoint's architecture, weight formats and a function that streams its weights.

    A GGUF file is parsed once for all three (its metadata alone takes seconds to read).
    """
    if source.is_gguf:
        from serval.runner.loader.gguf import (
            block_tensor_types,
            config_from_reader,
            iter_gguf_weights,
            open_gguf,
            packable_tensor_names,
            weight_formats,
        )

        reader = open_gguf(source.path)
        arch = ArchConfig.from_hf_config(config_from_reader(reader))
        return Checkpoint(
            arch,
            lambda packed_forms=None, packed_only=frozenset(), repack=None: iter_gguf_weights(
                source.path, reader, packed_forms, packed_only, repack
            ),
            weight_formats(reader),
            packable_tensor_names(reader),
            block_tensor_types(reader),
        )
    arch = ArchConfig.from_hf_config(read_hf_config(source.path))
    if read_pooling(source.path) is not None:  # an embedding model's head, if it has one, is never used
        arch = dataclasses.replace(arch, has_lm_head=False)
    if has_mxfp4_experts(source.path):  # gpt-oss's own checkpoints: experts packed from their MXFP4 blocks
        expert_types = mxfp4_expert_types(source.path)
        return Checkpoint(
            arch,
            lambda packed_forms=None, packed_only=frozenset(), repack=None: iter_mxfp4_checkpoint(
                source.path, packed_forms, packed_only, repack
            ),
            ("MXFP4", *(f for f in safetensors_formats(source.path) if f != "U8")),  # U8: the blocks
            frozenset(expert_types),
            expert_types,
        )
    return Checkpoint(
        arch,
        lambda packed_forms=None, packed_only=frozenset(), repack=None: iter_safetensors_weights(source.path),
        safetensors_formats(source.path),
    )


def load_model(
    arch: ArchConfig,
    weights: WeightsReader,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    pack_low_bit: bool = False,
    release_packed_dense: bool = False,
    packable_names: frozenset[str] = frozenset(),
    repack: NativeRepack | None = None,
    block_types: Mapping[str, int] | None = None,
) -> torch.nn.Module:
    """pack_low_bit: also keep the exact packed form of weights that have one (GGUF block types Q4_0 ... Q6_K,
    read from the file's blocks; Q4_0/Q4_1/Q8_0-shaped fp32 values of other checkpoints) for the quantized
    CPU kernels.
    release_packed_dense: the packed kernels serve every batch size, so a packed matrix's dense copy is
    freed as soon as the matrix is complete, and the matrices the reader packs from the file's blocks
    (packable_names) are never made dense at all.
    repack: the native kernels that pack a GGUF matrix's bytes in one pass (loader/gguf_pack.py NativeRepack);
    None: tensor ops do it, ~10x slower.
    block_types: Checkpoint.block_types; with repack, fused matrices of one block type are packed in place."""
    cls = model_class(arch.architecture)
    # Built on the meta device (no memory spent on random init) and materialized in the compute dtype, the
    # matrices each when their first tensor arrives (load_weights): the checkpoint streams in one tensor at
    # a time, so the load's peak is the model's own size (plus one matrix where dense copies are released),
    # never an fp32 copy of the whole model.
    with torch.device("meta"):
        model = cls(arch, max_positions).to(dtype)
    from_file: dict | None = {} if pack_low_bit else None
    packer = LowBitPacker(model, release_packed_dense, from_file) if pack_low_bit else None
    packed_only = packer.plan_packed_only(packable_names) if packer is not None else frozenset()
    if packer is not None and repack is not None and block_types:
        packer.plan_joined(block_types, repack.empty)
        repack = dataclasses.replace(repack, join_target=packer.join_target)
    _materialize_all_but_matrices(model)
    model.rotary = model._make_rotary(None)  # buffers built on meta must be recomputed for real

    def fp32_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights(from_file, packed_only, repack):
            tensor = tensor.to(torch.float32)
            if packer is not None:
                packer.release_completed()  # the tensors yielded before this one are copied by now
                packer.offer(name, tensor)
            yield name, tensor
            if tensor.numel() >= _LARGE_TENSOR:  # its temporaries are freed by now: keep the peak down
                _return_freed_heap()
        if packer is not None:
            packer.release_completed()

    model.load_weights(fp32_weights())
    if packer is not None:
        packer.attach()
    model = model.to(device=device)
    # The RoPE table stays fp32 whatever the weights' dtype: positions beyond a few thousand lose
    # precision in bf16.
    model.rotary = model.rotary.float()
    _return_freed_heap()
    return model.eval()


_LARGE_TENSOR = 1 << 24  # weights


def _return_freed_heap() -> None:
    """Give the load's freed temporaries back to the OS: glibc keeps freed heap pages resident (270 MB after
    a 1B load) unless asked. A no-op where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _materialize_all_but_matrices(model: torch.nn.Module) -> None:
    """Allocate (uninitialized) every parameter and buffer still on the meta device except the Linear layers'
    weights (those come with their first tensor; placeholders of packed-only ones are already real).

    NOTE: torch.empty with the shape, not torch.empty_like of the meta tensor: the latter goes through
    torch._refs, whose first use imports sympy (0.7 s of every start)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta and not (isinstance(module, Linear) and name == "weight"):
                setattr(
                    module,
                    name,
                    torch.nn.Parameter(_empty_cpu(param), param.requires_grad),
                )
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                persistent = name not in module._non_persistent_buffers_set
                module.register_buffer(name, _empty_cpu(buffer), persistent=persistent)


def _empty_cpu(meta: torch.Tensor) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
