"""gpt-oss's own Hugging Face checkpoints (openai/gpt-oss-20b, -120b): experts stored in MXFP4.

Such a directory's config.json says `"quantization_config": {"quant_method": "mxfp4"}`, and each layer's
experts are two pairs of uint8 tensors instead of dense ones: `mlp.experts.gate_up_proj_blocks`
(E, 2I, H / 32, 16), gate and up rows interleaved, with `gate_up_proj_scales` (E, 2I, H / 32), and
`down_proj_blocks` (E, H, I / 32, 16) with `down_proj_scales`. A block is 32 FP4 (e2m1) codes, two to a byte
(the low nibble first), under one power-of-two scale byte (e8m0, bias 127): GGML's MXFP4 block (type 39)
holds the same values, its scale byte first and element j beside element j + 16 in byte j. This module
reorders the bytes of each expert's matrix into GGML's blocks and hands them to the GGUF packing path
(loader/gguf_pack.py), so the experts load at the checkpoint's size, never dense; everything else streams
as the safetensors reader gives it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from serval.progress import progress
from serval.runner.loader.dequant import dequantize
from serval.runner.loader.gguf_pack import NativeRepack, packed_from_blocks
from serval.runner.loader.safetensors import read_hf_config, safetensors_files
from serval.runner.moe import split_fused_experts
from serval.runner.quantization import PackedWeight

_BLOCKS = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<part>gate_up_proj|down_proj)_blocks")
_MXFP4 = GGMLQuantizationType.MXFP4


def has_mxfp4_experts(directory: str) -> bool:
    """Whether a Hugging Face directory is a checkpoint whose experts are stored in MXFP4 (gpt-oss's)."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        return False
    quantization = read_hf_config(directory).get("quantization_config") or {}
    return quantization.get("quant_method") == "mxfp4"


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """One matrix's MXFP4 blocks (rows, K / 32, 16) and scales (rows, K / 32), uint8, as GGML's bytes
    (rows, K / 32 * 17): [scale, byte j = element j | element j + 16 << 4 for j < 16] a block."""
    low, high = blocks & 0x0F, blocks >> 4
    elements = torch.stack([low, high], dim=-1).flatten(-2)  # (rows, K / 32, 32) in order
    qs = elements[..., :16] | (elements[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(blocks.shape[0], -1).numpy()


def _expert_matrices(prefix: str, part: str, blocks: torch.Tensor, scales: torch.Tensor):
    """(Hugging Face per-expert name, GGML bytes, (rows, K)) of each expert's matrices."""
    num_blocks = blocks.shape[2]
    for e in range(blocks.shape[0]):
        if part == "down_proj":
            matrices = [("down_proj", blocks[e], scales[e])]
        else:  # rows interleave the gate's and up's
            matrices = [
                ("gate_proj", blocks[e, 0::2], scales[e, 0::2]),
                ("up_proj", blocks[e, 1::2], scales[e, 1::2]),
            ]
        for name, b, s in matrices:
            shape = (b.shape[0], num_blocks * 32)
            yield f"{prefix}.{e}.{name}.weight", ggml_blocks(b.contiguous(), s.contiguous()), shape


def mxfp4_expert_types(directory: str) -> Mapping[str, int]:
    """The GGML block type (MXFP4) of every expert matrix of the checkpoint, by per-expert Hugging Face name
    (headers only)."""
    types: dict[str, int] = {}
    for path in safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                match = _BLOCKS.fullmatch(name)
                if match is None:
                    continue
                num_experts = f.get_slice(name).get_shape()[0]
                parts = ["down_proj"] if match["part"] == "down_proj" else ["gate_proj", "up_proj"]
                for e in range(num_experts):
                    types.update({f"{match['prefix']}.{e}.{p}.weight": int(_MXFP4) for p in parts})
    return types


def iter_mxfp4_checkpoint(
    directory: str,
    packed_forms: dict[str, PackedWeight] | None = None,
    packed_only: frozenset[str] = frozenset(),
    repack: NativeRepack | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight with Hugging Face names, the experts one matrix each (as iter_gguf_weights yields a 3-D
    tensor's): packed into packed_forms from their blocks when asked, and dense only when not packed_only."""
    files = safetensors_files(directory)
    handles = [safe_open(path, framework="pt") for path in files]
    where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118
    names = [name for name in where if not name.endswith("_scales")]
    for name in progress(names, desc="loading weights", unit="tensor"):
        match = _BLOCKS.fullmatch(name)
        if match is None:
            tensor = where[name].get_tensor(name)
            # The experts' fused biases (E, 2I) and (E, H) as one per expert and projection, as the matrices.
            yield from split_fused_experts(name, tensor, transposed_interleaved=True) or [(name, tensor)]
            continue
        scales_name = name.removesuffix("_blocks") + "_scales"
        if scales_name not in where:
            raise ValueError(f"{directory}: {name} has no {scales_name}")
        blocks, scales = where[name].get_tensor(name), where[scales_name].get_tensor(scales_name)
        for expert_name, data, shape in _expert_matrices(match["prefix"], match["part"], blocks, scales):
            if packed_forms is not None:
                packed_forms[expert_name] = packed_from_blocks(data, _MXFP4, shape, None, repack, expert_name)
            if expert_name in packed_only:
                yield expert_name, torch.empty(shape, device="meta")
            else:
                yield expert_name, dequantize(data, _MXFP4, shape)
