"""Every GGUF block format serval runs packed (and F16/BF16, run as stored), on a tiny model of real block
shapes, against transformers.

The model is 256 wide (k-quant rows are whole 256-weight super-blocks) and is written in each format, and in
a mix like llama.cpp's Q4_K_M. transformers runs the weights its own GGUF loader dequantizes (with the gguf
package); serval runs the same file dense (`float32`: exact) and packed (`auto` on a CPU without native
bf16: fp32 activations over the file's codes).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.layers import Linear
from serval.runner.loader.gguf import read_gguf_config
from serval.runner.quantization import PackedParts, is_placeholder
from tests.fixtures.gguf_writer import write_gguf_from_state_dict
from tests.runner.test_models import _greedy, _serval_logits

Q = GGMLQuantizationType
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}


def _q4_k_m(name: str) -> GGMLQuantizationType:
    # llama.cpp's Q4_K_M, in short: Q6_K for the (tied) embedding and for attn_v and ffn_down of some layers
    # (here layer 0), Q4_K for the rest.
    if name == "token_embd.weight" or (
        name.startswith("blk.0.") and name.split(".")[2] in ("attn_v", "ffn_down")
    ):
        return Q.Q6_K
    return Q.Q4_K


FORMATS = {
    t.name: t
    for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.F16, Q.BF16)
} | {"Q4_K_M": _q4_k_m}
PROMPTS = [list(range(3, 40)), [7, 99, 250, 13, 13, 13, 5], list(range(300, 340, 2))]


@pytest.fixture(scope="module")
def state_dict() -> dict[str, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    return model.state_dict()


@pytest.fixture(scope="module", params=list(FORMATS))
def model_file(request, state_dict, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(path of the tiny model in this format, transformers on the weights transformers reads from it)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(tmp_path_factory.mktemp("formats") / f"{request.param}.gguf")
    hf_config = LlamaConfig(**SHAPE).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    write_gguf_from_state_dict(path, hf_config, state_dict, qtype_for_matrices=FORMATS[request.param])
    config = LlamaConfig(**read_gguf_config(path))
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    reference = LlamaForCausalLM(config).eval()
    missing = reference.load_state_dict(tensors, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}  # tied
    return path, reference


def _engine(path: str, dtype: str, batch_activations: str = "float32") -> Engine:
    """The exact paths unless asked (int8 batches, the default, are held to their own bound below)."""
    model = ModelConfig(model=path, dtype=dtype, batch_activations=batch_activations)
    return Engine(EngineConfig(model=model, cache=CacheConfig(num_blocks=64)))


def _decode_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The logits after the prompt, computed by a decode step (one new token over the prompt's cache)."""
    from serval.runner.batch import Batch

    table = [list(range(-(-(len(prompt) + 1) // engine.runner.block_size)))]
    engine.runner.compute_logits(Batch(prompt[:-1], [len(prompt) - 1], [0], table, [], []))
    return engine.runner.compute_logits(Batch(prompt[-1:], [1], [len(prompt) - 1], table, [0], []))[0]


def test_formats_match_transformers_dense_and_packed(model_file, kernels, monkeypatch):
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    monkeypatch.setattr("serval.runner.placement.cpu_has_native_bf16", lambda: False)
    path, reference = model_file
    dense, packed = _engine(path, "float32"), _engine(path, "auto")
    assert not dense.runner.info.packed_weights
    assert packed.runner.info.packed_weights and packed.runner.info.dtype == "float32"
    # Every matrix runs from its codes alone (its dense copy was freed), a fused one whose shards differ in
    # layout (the mix's q/k in Q4_K, v in Q6_K) in parts.
    linears = [m for m in packed.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and is_placeholder(m.weight) for m in linears)
    qkv = packed.runner.model.layers[0].self_attn.qkv_proj.packed
    assert isinstance(qkv, PackedParts) == (path.endswith("Q4_K_M.gguf"))
    for prompt in PROMPTS:
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt])).logits[0, -1]
        scale = theirs.abs().max().item()
        # Prefill (more than 8 rows: the file's exact weights in fp32) is exact on both paths.
        assert (_serval_logits(dense, prompt) - theirs).abs().max().item() < 1e-3 * scale
        assert (_serval_logits(packed, prompt) - theirs).abs().max().item() < 1e-3 * scale
        # A decode step rounds the activations to int16 per block of 32 (quantized_linear.cpp): within 1%.
        assert (_decode_logits(packed, prompt) - theirs).abs().max().item() < 1e-2 * scale
    assert _greedy(packed, PROMPTS, max_tokens=16) == _greedy(dense, PROMPTS, max_tokens=16)


def test_fused_shards_are_packed_straight_into_one_matrix(model_file, kernels, monkeypatch):
    """A fused matrix whose shards share one block type (gate/up; q/k/v too, but for Q4_K_M's Q6_K v) is
    packed shard by shard into its own buffers, byte for byte what packing each alone and joining gives."""
    from serval.runner.loader import gguf
    from serval.runner.loader.packer import LowBitPacker

    path, _ = model_file
    if path.endswith(("F16.gguf", "BF16.gguf")):
        pytest.skip("16-bit matrices are kept as stored: nothing to pack")
    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    planned: list[dict[str, int]] = []
    plan_joined = LowBitPacker.plan_joined

    def recording(self, block_types, empty):
        plan_joined(self, block_types, empty)
        planned.append(dict(self.joinable))

    monkeypatch.setattr(LowBitPacker, "plan_joined", recording)
    joined = _engine(path, "auto").runner.model
    expected = {"layers.0.mlp.gate_up_proj.weight", "layers.1.mlp.gate_up_proj.weight"}
    if not path.endswith("Q4_K_M.gguf"):
        expected |= {"layers.0.self_attn.qkv_proj.weight", "layers.1.self_attn.qkv_proj.weight"}
    assert len(planned) == 1 and expected <= set(planned[0].keys())
    monkeypatch.setattr(gguf, "block_tensor_types", lambda reader: {})  # every shard packed alone
    apart = _engine(path, "auto").runner.model
    for name in expected:
        module = name.removesuffix(".weight")
        one, other = joined.get_submodule(module).packed, apart.get_submodule(module).packed
        for field in ("codes", "scales", "offsets", "super_scales"):
            assert torch.equal(getattr(one, field), getattr(other, field)), (name, field)


def test_int8_batch_activations_stay_near_the_exact_path(state_dict, tmp_path, kernels, monkeypatch):
    """--batch-activations int8 (auto's choice on AVX2): prefill and one-row decode steps round x to int8 per
    block over 4-bit codes; the logits stay close to the exact path's."""
    from transformers import LlamaConfig

    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    monkeypatch.setattr("serval.runner.placement.cpu_has_native_bf16", lambda: False)
    path = str(tmp_path / "Q4_0.gguf")
    hf_config = LlamaConfig(**SHAPE).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    write_gguf_from_state_dict(path, hf_config, state_dict, qtype_for_matrices=Q.Q4_0)
    exact = _engine(path, "auto")
    rounded = Engine(
        EngineConfig(
            model=ModelConfig(model=path, batch_activations="int8"), cache=CacheConfig(num_blocks=64)
        )
    )
    in_effect = "float32" if kernels.variant == "portable" else "int8"  # the portable build has no int8 path
    assert rounded.runner.info.batch_activations == in_effect
    assert ("(packed, int8 batch activations" in rounded.runner.info.describe()) == (in_effect == "int8")
    assert exact.runner.info.batch_activations == "float32" and "(packed)," in exact.runner.info.describe()
    for prompt in PROMPTS:
        want = _serval_logits(exact, prompt)
        got = _serval_logits(rounded, prompt)
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() < 5e-2 * scale
        if kernels.int8_rows_from and len(prompt) >= kernels.int8_rows_from:
            assert not torch.equal(got, want)  # the portable build has no int8 path
        # A decode step's one row is int8 too; its cache holds the int8 prefill's K and V.
        decoded = _decode_logits(rounded, prompt)
        assert (decoded - _decode_logits(exact, prompt)).abs().max().item() < 5e-2 * scale
    with pytest.raises(ValueError, match="batch_activations"):
        ModelConfig(batch_activations="int4")


def test_auto_batch_activations_take_the_faster_path_of_each_variant(
    state_dict, tmp_path, kernels, monkeypatch
):
    """The default, auto: int8 x wherever AVX2 is (every x86 variant), int16 x in the portable build
    (kernels.default_batch_activations); either way one path for every row count."""
    from transformers import LlamaConfig

    monkeypatch.setenv("SERVAL_KERNEL_VARIANT", kernels.variant)
    path = str(tmp_path / "Q4_0.gguf")
    hf_config = LlamaConfig(**SHAPE).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    write_gguf_from_state_dict(path, hf_config, state_dict, qtype_for_matrices=Q.Q4_0)
    engine = Engine(EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(num_blocks=64)))
    assert engine.config.model.batch_activations == "auto"
    expected = "float32" if kernels.variant == "portable" else "int8"
    assert engine.runner.info.batch_activations == expected
    prompt = PROMPTS[0]
    chosen = _engine(path, "auto", expected)
    assert torch.equal(_serval_logits(engine, prompt), _serval_logits(chosen, prompt))
