"""The GGUF loader on the default model, with transformers' own GGUF loader as the oracle.

transformers dequantizes with the gguf package and undoes llama.cpp's q/k permutation, so equal q_proj and
k_proj weights prove our un-permutation (and equal everything else proves names and dequantization).
"""

from __future__ import annotations

import pytest
import torch

from serval.model_source import default_model_path
from serval.runner.loader.gguf import UnsupportedArchitectureError, iter_gguf_weights, read_gguf_config
from serval.runner.loader.gguf_names import hf_tensor_name


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def our_weights(model_path: str) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(model_path))


@pytest.fixture(scope="module")
def transformers_weights(model_path: str) -> dict[str, torch.Tensor]:
    # NOTE: the loader behind from_pretrained(gguf_file=...), called directly: from_pretrained itself wants
    # `accelerate` for GGUF files, which is not a dependency. It needs a model only for its parameter names
    # (the un-permutation reads heads from its own parse of the file), so a meta-device skeleton does.
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**read_gguf_config(model_path)))
    return load_gguf_checkpoint(model_path, return_tensors=True, model_to_load=skeleton)["tensors"]


def test_config_of_default_model(model_path: str) -> None:
    config = read_gguf_config(model_path)

    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["attention_bias"] is False
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in config


def test_weights_have_hf_names_and_shapes(our_weights: dict[str, torch.Tensor]) -> None:
    assert len(our_weights) == 2 + 30 * 9  # embedding, final norm; 9 tensors per layer; tied head
    assert "lm_head.weight" not in our_weights
    assert our_weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert our_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert our_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert our_weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert our_weights["model.layers.0.input_layernorm.weight"].shape == (576,)
    assert all(w.dtype == torch.float32 for w in our_weights.values())


def test_weights_equal_transformers_gguf_loader(
    our_weights: dict[str, torch.Tensor], transformers_weights: dict[str, torch.Tensor]
) -> None:
    assert set(our_weights) <= set(transformers_weights)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.17.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.29.post_attention_layernorm.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(our_weights[name], transformers_weights[name], rtol=0, atol=0, msg=name)
    for name, weight in our_weights.items():  # and the rest, in one sweep
        assert torch.equal(weight, transformers_weights[name]), name


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.12.attn_v.bias") == "model.layers.12.self_attn.v_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight") == "model.rotary_emb.freq_factors"
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_missing_file_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_gguf_config(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize(
    "content",
    [b"", b"not a gguf file at all", b"GGUF\x03\x00\x00\x00" + b"\xff" * 40],
    ids=["empty", "bad-magic", "garbage-header"],
)
def test_corrupt_file_is_value_error(tmp_path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf_config(str(path))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        next(iter_gguf_weights(str(path)))


def test_truncated_file_is_value_error(tmp_path) -> None:
    import gguf

    path = tmp_path / "truncated.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", torch.ones(64, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    content = path.read_bytes()
    path.write_bytes(content[: len(content) - 1000])  # the header and part of the tensor data

    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf_config(str(path))


def test_unknown_architecture_names_it(tmp_path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    for read in (read_gguf_config, lambda p: next(iter_gguf_weights(p))):
        with pytest.raises(
            UnsupportedArchitectureError,
            match="'mamba'.*glm4, glm4moe, gpt-oss, llama, minimax-m2, qwen2, qwen2moe, qwen3, qwen3moe",
        ):
            read(str(path))


def test_unsupported_tensor_type_fails_before_loading(tmp_path) -> None:
    import gguf
    import numpy as np

    from serval.runner.loader.dequant import UnsupportedQuantizationError

    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")  # no metadata: the type check comes first
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.add_tensor(
        "token_embd.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q2_K
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with pytest.raises(UnsupportedQuantizationError, match="token_embd.weight.*Q2_K.*Q4_K"):
        next(iter_gguf_weights(str(path)))
