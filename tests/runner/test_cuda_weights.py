"""Weights on CUDA, decided without a GPU (docs/cuda.md): `auto` computes in the checkpoint's 16-bit type as
stored; a GGUF's block-quantized matrices are dequantized once at load into the bf16 compute dtype, dense,
exactly the file's values rounded to bf16, 2 bytes a weight (run on the CPU with the native kernels disabled:
the same decision, placement.keeps_packed_weights)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.layers import Linear
from serval.runner.loader.gguf import iter_gguf_weights
from serval.runner.placement import keeps_packed_weights, resolve_dtype
from tests.fixtures.gguf_writer import write_gguf_from_state_dict
from tests.fixtures.tiny_models import tiny_config


def test_auto_dtype_on_cuda_keeps_the_stored_16_bit_type():
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", cuda, ("F16", "F32")) == torch.float16
    assert resolve_dtype("auto", cuda, ("BF16",)) == torch.bfloat16
    assert resolve_dtype("auto", cuda, ("F32",)) == torch.bfloat16  # fp32 checkpoints compute in bf16
    assert resolve_dtype("auto", cuda, ("Q4_K", "Q6_K")) == torch.bfloat16  # dequantized GGUF blocks
    assert resolve_dtype("float32", cuda, ("F16",)) == torch.float32  # asked for


def test_without_kernels_nothing_stays_packed():
    assert not keeps_packed_weights("auto", torch.bfloat16, None, has_packable_weights=True)


def test_block_formats_load_dense_in_bf16(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("SERVAL_DISABLE_NATIVE_KERNELS", "1")
    config = tiny_config("llama")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    path = str(tmp_path / "tiny-Q8_0.gguf")
    hf_config = config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    write_gguf_from_state_dict(path, hf_config, reference.state_dict(), GGMLQuantizationType.Q8_0)
    runner = Engine(
        EngineConfig(model=ModelConfig(model=path, dtype="bfloat16"), cache=CacheConfig(num_blocks=16))
    ).runner
    assert not runner.info.packed_weights and runner.info.weight_format.startswith("Q8_0")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is None and m.weight.dtype == torch.bfloat16 for m in linears)
    file_values = dict(iter_gguf_weights(path))
    o_proj = file_values["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(runner.model.layers[0].self_attn.o_proj.weight, o_proj.to(torch.bfloat16))
    # Not the unquantized weights: the file's Q8_0 values are what is loaded.
    assert not torch.equal(o_proj, reference.model.layers[0].self_attn.o_proj.weight)
    num_weights = sum(m.weight.numel() for m in linears)
    assert sum(m.weight.nbytes for m in linears) == 2 * num_weights
