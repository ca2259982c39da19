"""gpt-oss's own Hugging Face checkpoint format (openai/gpt-oss-*): experts stored as MXFP4 blocks and scales,
loaded packed from them (loader/mxfp4_experts.py), against transformers on the same dequantized values."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner import placement
from serval.runner.loader.mxfp4_experts import ggml_blocks
from serval.runner.moe import SparseMoe
from tests.runner.test_models import PROMPTS, _serval_logits, assert_greedy_matches

MXFP4 = GGMLQuantizationType.MXFP4


def _hf_blocks(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, K) fp32 quantized to MXFP4 by gguf, as the checkpoint stores it: blocks (rows, K / 32, 16)
    with the low nibble first, and scales (rows, K / 32); and the values they hold."""
    raw = quantize(rows, MXFP4).reshape(rows.shape[0], -1, 17)
    scales, qs = raw[..., 0], raw[..., 1:]
    elements = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGML: element j, then j + 16, in byte j
    blocks = elements[..., 0::2] | (elements[..., 1::2] << 4)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy())


def _write_mxfp4_checkpoint(directory: str, reference) -> None:
    """The tiny model as gpt-oss's checkpoints hold it, and `reference` given the values the blocks hold."""
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    for layer in range(reference.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for part in ("gate_up_proj", "down_proj"):
            weight = state.pop(f"{prefix}.{part}")  # (E, in, out): rows of the blocks are its outputs
            rows = weight.transpose(1, 2).contiguous()
            blocks, scales = zip(*(_hf_blocks(r.numpy()) for r in rows))
            state[f"{prefix}.{part}_blocks"] = torch.stack(blocks)
            state[f"{prefix}.{part}_scales"] = torch.stack(scales)
            values = torch.stack(
                [torch.from_numpy(dequantize(quantize(r.numpy(), MXFP4), MXFP4)) for r in rows]
            )
            with torch.no_grad():
                getattr(reference.model.layers[layer].mlp.experts, part).copy_(values.transpose(1, 2))
    os.makedirs(directory, exist_ok=True)
    save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def test_byte_order_conversion_keeps_every_value():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((16, 96)).astype(np.float32)
    blocks, scales = _hf_blocks(rows)
    assert np.array_equal(ggml_blocks(blocks, scales), quantize(rows, MXFP4).reshape(16, -1))


def test_mxfp4_checkpoint_loads_packed_and_matches_transformers(tmp_path, monkeypatch):
    from tests.fixtures.tiny_models import write_tiny_model

    # fp32 compute over the packed experts, as `auto` gives on a CPU without native bf16 (on one with it,
    # `auto` computes in bf16, whose rounding is past this test's 1e-3 against transformers' fp32).
    monkeypatch.setattr(placement, "cpu_has_native_bf16", lambda: False)

    directory = str(tmp_path / "gpt-oss-mxfp4")
    reference = write_tiny_model(directory, "gpt_oss")
    os.remove(os.path.join(directory, "model.safetensors"))
    _write_mxfp4_checkpoint(directory, reference)
    model = ModelConfig(model=directory, batch_activations="float32")  # dtype auto: the packed kernels
    engine = Engine(EngineConfig(model=model, cache=CacheConfig(num_blocks=64)))
    assert engine.runner.weight_formats[0] == "MXFP4"
    sparse = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, SparseMoe)]
    assert sparse and all(m.experts.gate_proj.packed is not None for m in sparse)  # never dense
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        assert (_serval_logits(engine, prompt) - theirs).abs().max().item() < 1e-3
    assert_greedy_matches(engine, reference, PROMPTS, max_tokens=8)
