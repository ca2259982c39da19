"""Turn a ModelSource into a ready model: architecture config, model class, weights, dtype and device."""

from __future__ import annotations

import torch

from serval.model_source import ModelSource
from serval.runner.loader.safetensors import iter_safetensors_weights, read_hf_config
from serval.runner.models.arch import ArchConfig
from serval.runner.models.registry import model_class


def read_arch_config(source: ModelSource) -> ArchConfig:
    if source.is_gguf:
        from serval.runner.loader.gguf import read_gguf_config

        return ArchConfig.from_hf_config(read_gguf_config(source.path))
    return ArchConfig.from_hf_config(read_hf_config(source.path))


def load_model(
    source: ModelSource, arch: ArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> torch.nn.Module:
    cls = model_class(arch.architecture)
    # Build on the meta device so that no memory is spent on random init, then materialize.
    with torch.device("meta"):
        model = cls(arch, max_positions)
    model = model.to_empty(device="cpu")
    model.rotary = model._make_rotary(None)  # buffers built on meta must be recomputed for real
    if source.is_gguf:
        from serval.runner.loader.gguf import iter_gguf_weights

        weights = iter_gguf_weights(source.path)
    else:
        weights = iter_safetensors_weights(source.path)
    model.load_weights((name, tensor.to(torch.float32)) for name, tensor in weights)
    model = model.to(dtype=dtype, device=device)
    # The RoPE table stays fp32 whatever the weights' dtype: positions beyond a few thousand lose
    # precision in bf16.
    model.rotary = model.rotary.float()
    return model.eval()
