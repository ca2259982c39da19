"""Tiny random models written as llama.cpp would (tests/fixtures/gguf_writer.py), read back by the loader.

For llama the writer applies llama.cpp's q/k row permutation, so getting the original weights back proves the
loader undoes exactly that; qwen2 (biases) and qwen3 (q/k norms, explicit head_dim) are not permuted.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from serval.runner.loader.gguf import iter_gguf_weights, read_gguf_config
from tests.fixtures.gguf_writer import write_gguf_from_state_dict

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _tiny_model(arch: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a seeded random model; every tensor random, norms and biases included."""
    import transformers

    if arch == "llama":  # with q/k/v biases, to check the bias rows are un-permuted too
        config = transformers.LlamaConfig(**SHAPE, attention_bias=True, tie_word_embeddings=False)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)
    else:
        config = transformers.Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # NOTE: fresh norms are all ones and biases all zeros, which would hide a swapped name; randomize all
    state_dict = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    return config.to_dict() | {"architectures": [type(model).__name__]}, state_dict


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request) -> tuple[str, dict, dict[str, torch.Tensor]]:
    return (request.param, *_tiny_model(request.param))


def test_config_round_trip(tiny, tmp_path) -> None:
    arch, hf_config, state_dict = tiny
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf_from_state_dict(path, hf_config, state_dict)

    config = read_gguf_config(path)

    assert config["architectures"] == hf_config["architectures"]
    assert config["model_type"] == arch
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == hf_config[key], key
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    assert config["head_dim"] == head_dim
    assert config["attention_bias"] == (arch != "qwen3")
    assert config["rope_theta"] == hf_config["rope_parameters"]["rope_theta"]
    assert "rope_scaling" not in config


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_weights_round_trip(tiny, tmp_path, qtype: GGMLQuantizationType) -> None:
    arch, hf_config, state_dict = tiny
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf_from_state_dict(path, hf_config, state_dict, qtype_for_matrices=qtype)

    weights = dict(iter_gguf_weights(path))

    expected = dict(state_dict)
    if hf_config["tie_word_embeddings"]:
        del expected["lm_head.weight"]
    assert set(weights) == set(expected)
    for name, want in expected.items():
        got = weights[name]
        assert got.shape == want.shape and got.dtype == torch.float32, name
        if qtype == GGMLQuantizationType.F32 or want.ndim == 1:
            assert torch.equal(got, want), name
        else:
            # Q8_0 keeps 8 bits per value against a per-32 scale: error within half a step, amax/254
            tolerance = want.abs().max() / 127
            assert (got - want).abs().max() <= tolerance, name
            assert (got - want).abs().mean() < tolerance / 4, name  # and not just bounded, but small


@pytest.mark.parametrize(
    ("rope_scaling", "expected"),
    [
        ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        ),
    ],
    ids=["linear", "yarn"],
)
def test_rope_scaling_round_trip(tmp_path, rope_scaling: dict, expected: dict) -> None:
    hf_config, state_dict = _tiny_model("qwen2")
    hf_config = hf_config | {"rope_scaling": rope_scaling}
    path = str(tmp_path / "scaled.gguf")
    write_gguf_from_state_dict(path, hf_config, state_dict)

    assert read_gguf_config(path)["rope_scaling"] == expected


def test_rope_freq_factors_are_yielded(tmp_path) -> None:
    hf_config, state_dict = _tiny_model("llama")
    factors = torch.linspace(1.0, 8.0, 8)  # (head_dim / 2,)
    state_dict["model.rotary_emb.freq_factors"] = factors
    path = str(tmp_path / "llama31.gguf")
    write_gguf_from_state_dict(path, hf_config, state_dict)

    weights = dict(iter_gguf_weights(path))

    assert torch.equal(weights["model.rotary_emb.freq_factors"], factors)


def test_vocab_size_falls_back_to_token_count(tmp_path) -> None:
    import gguf

    hf_config, state_dict = _tiny_model("qwen3")
    path = str(tmp_path / "no_vocab_key.gguf")
    write_gguf_from_state_dict(path, hf_config, state_dict)
    # rewrite without {arch}.vocab_size, as older converters did
    reader = gguf.GGUFReader(path)
    assert reader.get_field("qwen3.vocab_size") is not None
    stripped = str(tmp_path / "stripped.gguf")
    writer = gguf.GGUFWriter(stripped, "qwen3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "qwen3.vocab_size"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert read_gguf_config(stripped)["vocab_size"] == 256
