"""LoRA adapters in the runner against transformers + peft, on the tiny llama and random PEFT adapters.

Adapters and the base model share batches: each row must match its own reference, whatever else is in the
step. Bad adapters are refused with a ValueError naming the problem, before any slot is touched.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from serval.config import CacheConfig, EngineConfig, LoraConfig, LoraModule, ModelConfig
from serval.engine.engine import Engine
from serval.runner import lora as lora_module
from serval.runner.batch import Batch
from serval.sampling import SamplingParams

PROMPTS = [list(range(3, 40)), [7, 99, 250, 13, 13, 13, 5], list(range(300, 340, 2))]
ADAPTER_NAMES = ["full", "partial"]


def _engine(model: str, adapters: dict[str, str], dtype: str = "float32", **lora) -> Engine:
    modules = tuple(LoraModule(name, path) for name, path in adapters.items())
    config = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(num_blocks=64),
        lora=LoraConfig(enable_lora=True, lora_modules=modules, **lora),
    )
    return Engine(config)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tiny_lora_factory):
    """(engine with both adapters loaded, {name: reference model}; None is the base model)."""
    directory, base = tiny_model_factory("llama", False)
    adapters = {name: tiny_lora_factory(name) for name in ADAPTER_NAMES}
    engine = _engine(directory, {name: path for name, (path, _) in adapters.items()})
    references = {None: base, **{name: model for name, (_, model) in adapters.items()}}
    return engine, references


def _reference_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


def _batch_logits(engine: Engine, prompts: list[list[int]], names: list[str | None]) -> torch.Tensor:
    """One step computing every prompt whole, each with its adapter (None: base): the last rows' logits."""
    token_ids, block_tables, next_block = [], [], 0
    for prompt in prompts:
        num_blocks = -(-len(prompt) // engine.runner.block_size)
        token_ids += prompt
        block_tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    slots = [-1 if name is None else engine.loras.get(name).slot for name in names]
    batch = Batch(
        token_ids,
        [len(p) for p in prompts],
        [0] * len(prompts),
        block_tables,
        list(range(len(prompts))),
        [],
        lora_slots=slots,
    )
    return engine.runner.compute_logits(batch)


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_adapter_logits_match_peft(setup, name):
    engine, references = setup
    for prompt in PROMPTS:
        for end in (1, len(prompt) // 2, len(prompt)):
            ours = _batch_logits(engine, [prompt[:end]], [name])[0]
            theirs = _reference_logits(references[name], prompt[:end])
            assert (ours - theirs).abs().max().item() < 1e-3
    # The adapter matters: its logits are far from the base model's.
    base = _reference_logits(references[None], PROMPTS[0])
    assert (_reference_logits(references[name], PROMPTS[0]) - base).abs().max().item() > 0.05


@pytest.mark.parametrize("max_masked_tokens", [0, 10**6], ids=["gather rows", "mask rows"])
def test_base_and_two_adapters_in_one_batch(setup, monkeypatch, max_masked_tokens):
    # Both ways of picking a group's rows: index_select/index_add_ (long steps) and a 0/1 mask (short ones).
    monkeypatch.setattr(lora_module, "MAX_MASKED_TOKENS", max_masked_tokens)
    engine, references = setup
    # Every prompt under every model, all in one step, interleaved so that no group is contiguous.
    names = [None, "full", "partial"] * 3
    prompts = [PROMPTS[i // 3] for i in range(len(names))]
    logits = _batch_logits(engine, prompts, names)
    for row, (prompt, name) in enumerate(zip(prompts, names)):
        theirs = _reference_logits(references[name], prompt)
        assert (logits[row] - theirs).abs().max().item() < 1e-3, (row, name)


@pytest.mark.parametrize("max_masked_tokens", [0, 10**6], ids=["gather rows", "mask rows"])
def test_a_prompt_has_the_same_logits_alone_and_beside_other_adapters(setup, monkeypatch, max_masked_tokens):
    # Batch invariance with adapters: the deltas go through kernels.dense_linear, so a row's logits are the
    # same bits alone (its group: every row of the step) and gathered or masked out of a mixed step.
    if setup[0].runner.kernel_variant == "none":
        pytest.skip("no native kernels: the deltas take PyTorch's matmuls")
    monkeypatch.setattr(lora_module, "MAX_MASKED_TOKENS", max_masked_tokens)
    engine, _ = setup
    names = [None, "full", "partial"] * 3
    prompts = [PROMPTS[i // 3] for i in range(len(names))]
    logits = _batch_logits(engine, prompts, names)
    for row in range(len(names)):
        alone = _batch_logits(engine, [prompts[row]], [names[row]])[0]
        assert torch.equal(alone, logits[row]), (row, names[row])


def test_greedy_in_one_batch_matches_peft(setup):
    # Prefill and decode steps (a handful of rows, the small-batch path) with all three models batched.
    engine, references = setup
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    names = [None, "full", "partial"]
    for i, name in enumerate(names):
        engine.add_request(str(i), PROMPTS[i], params, lora_name=name)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(names))}
    batch_sizes = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            batch_sizes.append(output.timing.batch_sizes[-1])
    assert max(batch_sizes) == 3  # they really shared steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for i, name in enumerate(names):
        with torch.no_grad():
            out = references[name].generate(
                torch.tensor([PROMPTS[i]]), max_new_tokens=10, min_new_tokens=10, do_sample=False
            )
        assert tokens[str(i)] == out[0, len(PROMPTS[i]) :].tolist(), name


def test_unloaded_slot_computes_the_base_model(setup):
    engine, references = setup
    card = engine.remove_lora("partial")
    try:
        # A stale slot index (a bug elsewhere) must not leak the old weights.
        batch_logits = _batch_logits_for_slot(engine, PROMPTS[1], card.slot)
        assert (batch_logits - _reference_logits(references[None], PROMPTS[1])).abs().max().item() < 1e-3
    finally:
        engine.add_lora("partial", engine.runner.read_lora(card.path))


def _batch_logits_for_slot(engine: Engine, prompt: list[int], slot: int) -> torch.Tensor:
    batch = Batch(prompt, [len(prompt)], [0], [[0]], [0], [], lora_slots=[slot])
    return engine.runner.compute_logits(batch)[0]


def test_gguf_base_model_with_adapter(tiny_model_factory, tiny_lora_factory, tmp_path):
    # Adapters name Hugging Face modules; a GGUF checkpoint of the same weights takes them the same way.
    from tests.fixtures.gguf_writer import write_gguf_from_state_dict

    _, reference = tiny_model_factory("llama", False)
    path = str(tmp_path / "llama.gguf")
    write_gguf_from_state_dict(path, reference.config.to_dict(), reference.state_dict())
    adapter_path, peft_model = tiny_lora_factory("full")
    engine = _engine(path, {"full": adapter_path})
    for prompt in PROMPTS:
        ours = _batch_logits(engine, [prompt], ["full"])[0]
        assert (ours - _reference_logits(peft_model, prompt)).abs().max().item() < 1e-3


def test_bf16_adapter_stays_close_to_fp32(tiny_model_factory, tiny_lora_factory):
    # bf16 weights take the native small-batch matmul where the CPU has one; the delta is added after it.
    directory, _ = tiny_model_factory("llama", False)
    adapter_path, peft_model = tiny_lora_factory("full")
    engine = _engine(directory, {"full": adapter_path}, dtype="bfloat16")
    for prompt in PROMPTS:
        for end in (1, len(prompt)):  # a one-row step and a prefill
            ours = _batch_logits(engine, [prompt[:end]], ["full"])[0]
            theirs = _reference_logits(peft_model, prompt[:end])
            assert (ours - theirs).abs().max().item() < 0.03


def _copy_adapter(source: str, destination) -> str:
    shutil.copytree(source, destination)
    return str(destination)


def _edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def _edit_tensors(path: str, edit) -> None:
    weights_path = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights_path)
    edit(tensors)
    save_file(tensors, weights_path)


def _first_key(tensors: dict, part: str) -> str:
    return next(k for k in sorted(tensors) if part in k)


def _overwrite(path: str, name: str, data: bytes) -> None:
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)


def _add_module(path: str, module: str, rank: int = 8, in_features: int = 64, out_features: int = 64) -> None:
    """Add a LoRA pair for `module` (a name below base_model.model.) to the adapter's tensors."""
    prefix = f"base_model.model.{module}"
    _edit_tensors(
        path,
        lambda t: t.update(
            {
                f"{prefix}.lora_A.weight": torch.zeros(rank, in_features),
                f"{prefix}.lora_B.weight": torch.zeros(out_features, rank),
            }
        ),
    )


# (what is wrong, how to make it so, a piece of the expected message)
BAD_ADAPTERS = [
    ("DoRA", lambda p: _edit_config(p, use_dora=True), "DoRA"),
    ("modules_to_save", lambda p: _edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    ("fan_in_fan_out", lambda p: _edit_config(p, fan_in_fan_out=True), "fan_in_fan_out"),
    ("bias", lambda p: _edit_config(p, bias="lora_only"), "bias"),
    ("rank_pattern", lambda p: _edit_config(p, rank_pattern={"q_proj": 4}), "rank_pattern"),
    ("not LoRA", lambda p: _edit_config(p, peft_type="IA3"), "IA3"),
    ("rank too large", lambda p: _edit_config(p, r=32), "--max-lora-rank"),
    ("rank mismatch", lambda p: _edit_config(p, r=4), "does not fit"),
    ("bad rank", lambda p: _edit_config(p, r="8"), "positive integer"),
    ("no config", lambda p: os.remove(os.path.join(p, "adapter_config.json")), "adapter_config.json"),
    ("bad json", lambda p: _overwrite(p, "adapter_config.json", b"{"), "not valid JSON"),
    ("no weights", lambda p: os.remove(os.path.join(p, "adapter_model.safetensors")), "safetensors"),
    ("corrupt weights", lambda p: _overwrite(p, "adapter_model.safetensors", b"garbage" * 10), "cannot read"),
    ("lm_head", lambda p: _add_module(p, "lm_head", out_features=384), "targets 'lm_head'"),
    (
        "unknown module",
        lambda p: _add_module(p, "model.layers.0.mlp.act_fn"),
        "act_fn', which is not supported",
    ),
    (
        "not LoRA tensors",
        lambda p: _edit_tensors(p, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(2)})),
        "not a LoRA matrix",
    ),
    ("layer out of range", lambda p: _add_module(p, "model.layers.9.self_attn.q_proj"), "layer 9"),
    ("A without B", lambda p: _edit_tensors(p, lambda t: t.pop(_first_key(t, "lora_B"))), "not both"),
    (
        "wrong shape",
        lambda p: _edit_tensors(p, lambda t: t.update({_first_key(t, "q_proj.lora_B"): torch.zeros(32, 8)})),
        "does not fit",
    ),
    ("no tensors", lambda p: save_file({}, os.path.join(p, "adapter_model.safetensors")), "no LoRA weights"),
]


@pytest.mark.parametrize(("problem", "make", "message"), BAD_ADAPTERS, ids=[b[0] for b in BAD_ADAPTERS])
def test_bad_adapters_are_refused(setup, tiny_lora_factory, tmp_path, problem, make, message):
    engine, _ = setup
    path = _copy_adapter(tiny_lora_factory("full")[0], tmp_path / "adapter")
    make(path)
    with pytest.raises(ValueError, match=message):
        engine.runner.read_lora(path)


def test_read_lora_without_lora_enabled(tiny_model_factory, tiny_lora_factory):
    directory, _ = tiny_model_factory("llama", False)
    engine = Engine(
        EngineConfig(model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=8))
    )
    assert engine.runner.info.max_loras == 0
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.runner.read_lora(tiny_lora_factory("full")[0])
