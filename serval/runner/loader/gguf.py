"""Reading a llama.cpp GGUF file as a Hugging Face checkpoint: a config.json-style dict and named weights.

Owns the translation from llama.cpp's conventions to Hugging Face's: metadata keys to config fields, tensor
names (through gguf_names.py) and, for the llama architecture, undoing the converter's reordering of q/k
rows. The byte layouts of quantized data live in `dequant.py`.
Everything downstream of this module sees the same names and values a safetensors checkpoint would give.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from serval.progress import progress
from serval.runner.loader.dequant import (
    BLOCK_CODE_TYPES,
    SUPPORTED_TYPES,
    UnsupportedQuantizationError,
    dequantize,
    is_supported,
)
from serval.runner.loader.gguf_deepseek import deepseek2_config, yarn_mscale_keys
from serval.runner.loader.gguf_file import GGUFFile
from serval.runner.loader.gguf_names import SPLIT_KV_B_PARTS, hf_matrix_names
from serval.runner.loader.gguf_pack import NativeRepack, packed_from_blocks, unpermute_rows
from serval.runner.quantization import PackedWeight, sixteen_bit_form

# general.architecture -> (Hugging Face class, model_type). llama.cpp writes Mistral (v0.1-v0.3) as llama.
_ARCHITECTURES: MappingProxyType[str, tuple[str, str]] = MappingProxyType(
    {
        "llama": ("LlamaForCausalLM", "llama"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"),
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
        "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
        "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
        "glm4": ("Glm4ForCausalLM", "glm4"),
        # transformers' GLM (GLM-4-9B-chat-hf); with q/k/v fused (attn_qkv), THUDM's ChatGLM2/3: _CHATGLM
        "chatglm": ("GlmForCausalLM", "glm"),
        "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe"),
        "minimax-m2": ("MiniMaxM2ForCausalLM", "minimax_m2"),
        "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # or V3 (gguf_deepseek.py: the router's kind)
    }
)
# llama.cpp writes Mixtral as llama with experts.
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# ChatGLM2/3's files keep its fused q/k/v (blk.N.attn_qkv); model_type glm: the keys below are transformers'.
_CHATGLM = ("ChatGLMModel", "glm")
# Whether the routing weights are renormalized over the chosen experts when the file has no
# {arch}.expert_weights_norm (llama.cpp's defaults per architecture).
_RENORMALIZES_BY_DEFAULT = MappingProxyType({"llama": True, "qwen2moe": False, "qwen3moe": True})
# Architectures whose experts are feed_forward_length wide in Hugging Face's config (intermediate_size).
_EXPERT_WIDTH_IS_INTERMEDIATE = frozenset({"llama", "gpt-oss", "minimax-m2"})
# DeepSeek-style routing keys -> their Hugging Face config keys (absent: the family's defaults).
_ROUTER_KEYS = MappingProxyType(
    {
        "expert_shared_count": "n_shared_experts",
        "leading_dense_block_count": "first_k_dense_replace",
        "expert_weights_scale": "routed_scaling_factor",
        "expert_group_count": "n_group",
        "expert_group_used_count": "topk_group",
    }
)
# YaRN's `truncate` (GGUF has no key for it): gpt-oss's config.json says false, transformers' default is true.
_YARN_TRUNCATES = MappingProxyType({"gpt-oss": False})
# Architectures whose converter interleaves the two rotary halves of every q/k head
# (gguf_pack.unpermute_rows undoes it).
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})


# The routers' scoring function (llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid): a fact of the
# architecture here (MoeArch.scoring), checked against the file.
_GATING_OF_ARCHITECTURE = MappingProxyType({"glm4moe": 2, "minimax-m2": 2})


class UnsupportedArchitectureError(ValueError):
    """The file's general.architecture is not one serval can run."""


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor directory (tensor data mapped, not read), with clear errors for a
    missing or unreadable file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"not a GGUF file (not a regular file): {path}")
    try:
        return GGUFFile(path)
    except (ValueError, struct.error, OverflowError, MemoryError) as error:
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated?): {error}") from error


def metadata_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The decoded value of one metadata key (str, int, float, bool or a list of them), or `default`."""
    return reader.metadata.get(key, default)


def _float(value: float) -> float:
    # GGUF stores these as float32; print them the way float32 does so 1e-5 reads 1e-05, not 9.99999974e-06
    return float(str(np.float32(value)))


def _moe_config(reader: GGUFFile, arch: str, num_layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face config keys of a mixture of experts' GGUF ({arch}.expert_* metadata); empty for a
    dense model. A layer without a router is dense (mlp_only_layers)."""
    num_experts = metadata_value(reader, f"{arch}.expert_count", 0)
    if not num_experts:
        return {}
    feed_forward = metadata_value(reader, f"{arch}.feed_forward_length")
    config: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": metadata_value(reader, f"{arch}.expert_used_count"),
        # Mixtral's experts are feed_forward_length wide; Qwen-MoE's have their own width
        "moe_intermediate_size": metadata_value(reader, f"{arch}.expert_feed_forward_length", feed_forward),
        "norm_topk_prob": bool(
            metadata_value(reader, f"{arch}.expert_weights_norm", _RENORMALIZES_BY_DEFAULT.get(arch, True))
        ),
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        ],
    }
    if config["num_experts_per_tok"] is None:
        raise ValueError(f"GGUF metadata has {arch}.expert_count but no {arch}.expert_used_count")
    shared = metadata_value(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        config["shared_expert_intermediate_size"] = shared
    for gguf_key, hf_key in _ROUTER_KEYS.items():
        value = metadata_value(reader, f"{arch}.{gguf_key}")
        if value is not None:
            config[hf_key] = _float(value) if isinstance(value, float) else value
    gating = metadata_value(reader, f"{arch}.expert_gating_func")
    if gating is not None and arch != "deepseek2" and int(gating) != _GATING_OF_ARCHITECTURE.get(arch, 1):
        raise ValueError(f"GGUF {arch}.expert_gating_func {gating} is not the one serval runs for {arch}")
    if arch in _EXPERT_WIDTH_IS_INTERMEDIATE:
        config["intermediate_size"] = config["moe_intermediate_size"]
    return config


def _architecture(reader: GGUFFile) -> str:
    arch = metadata_value(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported architectures: {supported}"
        )
    return arch


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    """Hugging Face `rope_scaling` from llama.cpp's rope.scaling.* keys (or the older rope.scale_linear)."""
    kind = metadata_value(reader, f"{arch}.rope.scaling.type")
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    legacy_factor = metadata_value(reader, f"{arch}.rope.scale_linear")
    if kind is None and legacy_factor is not None:
        kind, factor = "linear", legacy_factor
    if kind in (None, "none"):
        return None
    if factor is None:
        raise ValueError(f"GGUF rope scaling type {kind!r} has no {arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _float(factor)}
        if arch in _YARN_TRUNCATES:
            scaling["truncate"] = _YARN_TRUNCATES[arch]
        optional = {
            "original_max_position_embeddings": "original_context_length",
            "beta_fast": "yarn_beta_fast",
            "beta_slow": "yarn_beta_slow",
            "attention_factor": "attn_factor",
        }
        for hf_key, gguf_key in optional.items():
            value = metadata_value(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = value if isinstance(value, int) else _float(value)
        return scaling | yarn_mscale_keys(metadata_value(reader, f"{arch}.rope.scaling.yarn_log_multiplier"))
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def config_from_reader(reader: GGUFFile) -> dict[str, Any]:
    """The config dict of an already open file (see read_gguf_config)."""
    arch = _architecture(reader)

    def required(key: str) -> Any:
        value = metadata_value(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return value

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    num_kv_heads = metadata_value(reader, f"{arch}.attention.head_count_kv", num_heads)
    vocab_size = metadata_value(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = metadata_value(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab_size = len(tokens)
    # GLM-4.5's files count its multi-token-prediction layer among the blocks; it is not served
    num_nextn = metadata_value(reader, f"{arch}.nextn_predict_layers", 0)
    num_layers = required("block_count") - num_nextn
    moe = _moe_config(reader, arch, num_layers, tensor_names)
    class_name, model_type = _ARCHITECTURES[arch]
    if arch == "llama" and moe:
        class_name, model_type = _MIXTRAL
    elif arch == "chatglm" and "blk.0.attn_qkv.weight" in tensor_names:
        class_name, model_type = _CHATGLM
    feed_forward = metadata_value(reader, f"{arch}.feed_forward_length")
    if feed_forward is None and not moe:
        raise ValueError(f"GGUF metadata has no {arch}.feed_forward_length")
    config: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": feed_forward or moe["moe_intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        # NOTE: some converters write per-layer lists here; the dense models served here have one value
        "num_key_value_heads": max(num_kv_heads) if isinstance(num_kv_heads, list) else num_kv_heads,
        "head_dim": metadata_value(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": _float(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float(metadata_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": required("context_length"),
        "vocab_size": vocab_size,
        # llama.cpp writes output.weight only when the head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": bool(
            {"blk.0.attn_q.bias", "blk.0.attn_qkv.bias", "blk.0.attn_output.bias"} & tensor_names
        ),
        "bos_token_id": metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata_value(reader, "tokenizer.ggml.eos_token_id"),
    }
    config.update(moe)
    config.update(_optional_config(reader, arch, tensor_names))
    if num_nextn:
        config["num_nextn_predict_layers"] = num_nextn
    return config


def _optional_config(reader: GGUFFile, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The config keys a file may or may not have: partial RoPE, q/k norms, padding, rope scaling, window."""
    config: dict[str, Any] = {}
    rotary_dim = metadata_value(reader, f"{arch}.rope.dimension_count")
    if rotary_dim is not None:  # partial RoPE where smaller than the head
        config["rotary_dim"] = rotary_dim
    if "blk.0.attn_q_norm.weight" in tensor_names:  # GLM-4.5's q/k norms are optional (use_qk_norm)
        config["use_qk_norm"] = True
    if arch == "deepseek2":  # MLA's shapes, and V2 or V3
        config.update(deepseek2_config(reader.metadata, tensor_names))
    pad_token_id = metadata_value(reader, "tokenizer.ggml.padding_token_id")
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    sliding_window = metadata_value(reader, f"{arch}.attention.sliding_window")
    if sliding_window:  # the layers it applies to are the architecture's fact (ArchConfig)
        config["sliding_window"] = sliding_window
    return config


def read_gguf_config(path: str) -> dict[str, Any]:
    """A Hugging Face config.json-style dict built from the file's metadata and tensor names."""
    return config_from_reader(open_gguf(path))


def weight_formats(reader: GGUFFile) -> tuple[str, ...]:
    """The ggml types of the file's matrices ("Q4_1", "Q8_0", ...), most weights first; 1-D tensors (norms,
    biases) are not counted."""
    weights_by_type: dict[str, int] = {}
    for tensor in reader.tensors:
        if len(tensor.shape) >= 2:
            name = tensor.tensor_type.name
            weights_by_type[name] = weights_by_type.get(name, 0) + int(tensor.n_elements)
    return tuple(sorted(weights_by_type, key=weights_by_type.__getitem__, reverse=True))


# Matrices of these types are kept as the file stores them (quantization.sixteen_bit_form).
_SIXTEEN_BIT_TYPES = frozenset({GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def packable_tensor_names(reader: GGUFFile) -> frozenset[str]:
    """The Hugging Face names of the file's matrices the quantized kernels run from their stored form."""
    arch = metadata_value(reader, "general.architecture", "")
    return frozenset(
        name for t in reader.tensors if _is_packable_matrix(t) for name in hf_matrix_names(t, arch)
    )


def block_tensor_types(reader: GGUFFile) -> Mapping[str, int]:
    """The GGML block type (Q4_0 ... Q6_K) of each matrix stored in one, by Hugging Face name."""
    arch = metadata_value(reader, "general.architecture", "")
    return MappingProxyType(
        {
            name: int(t.tensor_type)
            for t in reader.tensors
            if _is_packable_matrix(t) and t.tensor_type in BLOCK_CODE_TYPES
            for name in hf_matrix_names(t, arch)
        }
    )


def _is_packable_matrix(tensor) -> bool:
    """A matrix (or a 3-D stack of experts' matrices) stored in a block type the quantized kernels run
    packed, or in fp16/bf16."""
    return (
        len(tensor.shape) in (2, 3)
        and tensor.name.endswith(".weight")
        and tensor.name.split(".")[-2] not in SPLIT_KV_B_PARTS  # joined into kv_b_proj: dense
        and (tensor.tensor_type in BLOCK_CODE_TYPES or tensor.tensor_type in _SIXTEEN_BIT_TYPES)
    )


def _sixteen_bit_from_file(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> torch.Tensor:
    """A copy of an F16 (typed view) or BF16 ((rows, bytes) view) matrix's values, in torch's dtype."""
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(data, dtype=np.float16).reshape(shape))
    return torch.from_numpy(np.array(data).view(np.int16).reshape(shape)).view(torch.bfloat16)


def iter_gguf_weights(
    path: str,
    reader: GGUFFile | None = None,
    packed_forms: dict[str, PackedWeight] | None = None,
    packed_only: frozenset[str] = frozenset(),
    repack: NativeRepack | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file as (Hugging Face name, float32 tensor in PyTorch orientation).

    Pass the reader when the caller already opened the file: parsing the metadata takes seconds.
    packed_forms: also put there, before yielding it, the packed form (runner/quantization.py) of each
    matrix of a block type (Q4_0 ... Q6_K), built from its bytes, and the 16-bit form of each F16/BF16 one.
    packed_only: names whose dense values nobody needs (the model runs them packed): yielded as meta
    tensors of their shape, never dequantized, after their packed form is put in packed_forms.
    repack: the native packing kernels (NativeRepack), or None.
    """
    reader = reader or open_gguf(path)
    # the architecture, names and types are checked up front, so a bad file fails before minutes of
    # dequantizing, not after
    _architecture(reader)
    arch = metadata_value(reader, "general.architecture")
    names = [hf_matrix_names(tensor, arch) for tensor in reader.tensors]
    _check_types(path, reader)
    config = config_from_reader(reader)
    is_permuted = metadata_value(reader, "general.architecture") in _PERMUTED_QK_ARCHITECTURES
    # rows of q_proj are grouped by query head, rows of k_proj by key/value head
    heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = progress(reader.tensors, desc="loading GGUF weights", unit="tensor")
    for matrix_names, tensor in zip(names, tensors):
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF ne is fastest-first; torch is last
        part = tensor.name.split(".")[-2]  # "blk.0.attn_q.weight" -> "attn_q"
        heads = heads_of[part] if is_permuted and part in heads_of else None
        packable = packed_forms is not None and _is_packable_matrix(tensor)
        # A 3-D tensor is one matrix per expert (its data's first axis), each yielded under its own name (a
        # 2-D one of biases, one row per expert).
        stacked = len(matrix_names) > 1 or len(shape) == 3 or (len(shape) == 2 and "_exps." in tensor.name)
        for index, name in enumerate(matrix_names):
            data, matrix_shape = (tensor.data[index], shape[1:]) if stacked else (tensor.data, shape)
            if packable and name in packed_only:
                weight = torch.empty(matrix_shape, device="meta")
            else:
                weight = dequantize(data, tensor.tensor_type, matrix_shape)
                if heads is not None:
                    weight = unpermute_rows(weight, heads)
                if name.endswith("shared_expert_gate.weight"):  # ggml's [n_embd] is HF's (1, hidden)
                    weight = weight.reshape(1, -1)
            if packable and tensor.tensor_type in _SIXTEEN_BIT_TYPES:
                values = _sixteen_bit_from_file(data, tensor.tensor_type, matrix_shape)
                packed_forms[name] = sixteen_bit_form(
                    values if heads is None else unpermute_rows(values, heads)
                )
            elif packable:
                packed_forms[name] = packed_from_blocks(
                    data, tensor.tensor_type, matrix_shape, heads, repack, name
                )
            yield name, weight
        reader.release_pages(tensor.data_offset, tensor.n_bytes)  # every result owns its memory


def _check_types(path: str, reader: GGUFFile) -> None:
    """UnsupportedQuantizationError naming the first tensor of a type the loader can't read."""
    unsupported = [t for t in reader.tensors if not is_supported(t.tensor_type)]
    if unsupported:
        first = unsupported[0]
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise UnsupportedQuantizationError(
            f"{path}: tensor {first.name} (and {len(unsupported) - 1} more) has type {first.tensor_type.name},"
            f" which is not supported; supported types: {supported}"
        )
