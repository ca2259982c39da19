"""Turn a ModelSource into a ready model: architecture config, model class, weights, dtype and device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from serval.model_source import ModelSource
from serval.runner.layers import Linear
from serval.runner.loader.dequant import BLOCK_CODE_TYPES
from serval.runner.loader.safetensors import iter_safetensors_weights, read_hf_config, safetensors_formats
from serval.runner.models.arch import ArchConfig
from serval.runner.models.registry import model_class
from serval.runner.quantization import LowBitPacker

# Streams the weights with Hugging Face names; given a dict, a reader that can also fills it with the packed
# forms (runner/quantization.py) it builds from the file's own blocks, each before its tensor.
WeightsReader = Callable[..., Iterator[tuple[str, torch.Tensor]]]


# GGUF tensor types whose weights the quantized kernels run from their packed form (runner/quantization.py).
PACKABLE_GGUF_TYPES = frozenset(t.name for t in BLOCK_CODE_TYPES)


@dataclass(frozen=True)
class Checkpoint:
    arch: ArchConfig
    read_weights: WeightsReader  # streams the weights with Hugging Face names
    # The stored weight formats of its matrices, most weights first: GGUF types ("Q4_1", "Q8_0", "F16") or
    # safetensors dtypes ("BF16"); 1-D tensors (norms, biases) are not counted.
    weight_formats: tuple[str, ...]

    @property
    def has_packable_weights(self) -> bool:
        return any(f in PACKABLE_GGUF_TYPES for f in self.weight_formats)


def open_checkpoint(source: ModelSource) -> Checkpoint:
    """The checkpoint's architecture, weight formats and a function that streams its weights.

    A GGUF file is parsed once for all three (its metadata alone takes seconds to read).
    """
    if source.is_gguf:
        from serval.runner.loader.gguf import config_from_reader, iter_gguf_weights, open_gguf, weight_formats

        reader = open_gguf(source.path)
        arch = ArchConfig.from_hf_config(config_from_reader(reader))
        return Checkpoint(
            arch,
            lambda packed_forms=None: iter_gguf_weights(source.path, reader, packed_forms),
            weight_formats(reader),
        )
    arch = ArchConfig.from_hf_config(read_hf_config(source.path))
    return Checkpoint(
        arch,
        lambda packed_forms=None: iter_safetensors_weights(source.path),
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
) -> torch.nn.Module:
    """pack_low_bit: also keep the exact packed form of weights that have one (GGUF block types Q4_0 ... Q6_K,
    read from the file's blocks; Q4_0/Q4_1/Q8_0-shaped fp32 values of other checkpoints) for the quantized
    CPU kernels.
    release_packed_dense: the packed kernels serve every batch size, so a packed matrix's dense copy is
    freed as soon as the matrix is complete."""
    cls = model_class(arch.architecture)
    # Built on the meta device (no memory spent on random init) and materialized in the compute dtype, the
    # matrices each when their first tensor arrives (load_weights): the checkpoint streams in one tensor at
    # a time, so the load's peak is the model's own size (plus one matrix where dense copies are released),
    # never an fp32 copy of the whole model.
    with torch.device("meta"):
        model = cls(arch, max_positions).to(dtype)
    _materialize_all_but_matrices(model)
    model.rotary = model._make_rotary(None)  # buffers built on meta must be recomputed for real
    from_file: dict | None = {} if pack_low_bit else None
    packer = LowBitPacker(model, release_packed_dense, from_file) if pack_low_bit else None

    def fp32_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights(from_file):
            tensor = tensor.to(torch.float32)
            if packer is not None:
                packer.release_completed()  # the tensors yielded before this one are copied by now
                packer.offer(name, tensor)
            yield name, tensor
        if packer is not None:
            packer.release_completed()

    model.load_weights(fp32_weights())
    if packer is not None:
        packer.attach()
    model = model.to(device=device)
    # The RoPE table stays fp32 whatever the weights' dtype: positions beyond a few thousand lose
    # precision in bf16.
    model.rotary = model.rotary.float()
    return model.eval()


def _materialize_all_but_matrices(model: torch.nn.Module) -> None:
    """Allocate (uninitialized) every parameter and buffer except the Linear layers' weights."""
    for module in model.modules():
        if not isinstance(module, Linear):
            module.to_empty(device="cpu", recurse=False)
            continue
        for name, param in module.named_parameters(recurse=False):
            if name != "weight":
                setattr(
                    module,
                    name,
                    torch.nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad),
                )
