"""LoRA in the engine: the adapter table, prefix-cache isolation between adapters, the unload policy, and
loading through EngineClient on the engine thread. The tiny llama and random PEFT adapters are real."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serval.config import CacheConfig, EngineConfig, LoraConfig, LoraModule, ModelConfig
from serval.engine.block_manager import BlockManager
from serval.engine.client import EngineClient
from serval.engine.engine import Engine
from serval.engine.lora import LoraCard, LoraConflictError, LoraError, LoraRegistry, UnknownLoraError
from serval.engine.request import Request
from serval.sampling import SamplingParams
from tests.engine.block_helpers import prefill

BLOCK_SIZE = 16
PROMPT = list(range(3, 3 + 3 * BLOCK_SIZE + 5))  # three full blocks and a bit
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _engine(model: str, adapters: dict[str, str], max_loras: int = 2) -> Engine:
    config = EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK_SIZE),
        lora=LoraConfig(
            enable_lora=True,
            max_loras=max_loras,
            lora_modules=tuple(LoraModule(n, p) for n, p in adapters.items()),
        ),
    )
    return Engine(config)


@pytest.fixture
def engine(tiny_model_factory, tiny_lora_factory) -> Engine:
    directory, _ = tiny_model_factory("llama", False)
    return _engine(
        directory, {"full": tiny_lora_factory("full")[0], "partial": tiny_lora_factory("partial")[0]}
    )


def _run(engine: Engine, request_id: str, lora_name: str | None) -> int:
    """Run one request to the end; its prompt tokens found in the prefix cache."""
    engine.add_request(request_id, PROMPT, PARAMS, lora_name=lora_name)
    num_cached = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_cached = output.num_cached_tokens
    return num_cached


def test_prefix_cache_is_never_shared_across_adapters(engine):
    full_blocks = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert _run(engine, "base-1", None) == 0
    assert _run(engine, "full-1", "full") == 0  # the base model's blocks are not the adapter's
    assert _run(engine, "partial-1", "partial") == 0  # nor another adapter's
    assert _run(engine, "full-2", "full") == full_blocks  # the same adapter's are
    assert _run(engine, "partial-2", "partial") == full_blocks
    assert _run(engine, "base-2", None) == full_blocks
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_reloaded_adapter_does_not_find_its_old_blocks(engine):
    # The same name may come back with other weights: a new load is a new hash chain.
    path = engine.loras.get("full").path
    assert _run(engine, "a", "full") == 0
    engine.remove_lora("full")
    engine.add_lora("full", engine.runner.read_lora(path))
    assert _run(engine, "b", "full") == 0
    assert _run(engine, "c", "full") > 0


def test_unload_is_refused_while_a_request_uses_the_adapter(engine):
    engine.add_request("r", PROMPT, PARAMS, lora_name="partial")
    engine.step()
    with pytest.raises(LoraConflictError, match="in use by 1 request"):
        engine.remove_lora("partial")
    engine.remove_lora("full")  # an idle one goes
    while engine.has_unfinished_requests():
        engine.step()
    card = engine.remove_lora("partial")
    assert card.name == "partial" and not engine.loras.cards
    with pytest.raises(UnknownLoraError):
        engine.add_request("s", PROMPT, PARAMS, lora_name="partial")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_adapter_table_errors(engine, tiny_lora_factory):
    adapter = engine.runner.read_lora(tiny_lora_factory("full")[0])
    with pytest.raises(LoraError, match="already loaded"):
        engine.add_lora("full", adapter)
    with pytest.raises(LoraConflictError, match="all 2 LoRA slots"):
        engine.add_lora("third", adapter)
    with pytest.raises(UnknownLoraError):
        engine.remove_lora("third")
    with pytest.raises(UnknownLoraError):
        engine.add_request("x", PROMPT, PARAMS, lora_name="third")
    # A freed slot is reused, with a fresh hash seed.
    old = engine.remove_lora("full")
    new = engine.add_lora("third", adapter)
    assert new.slot == old.slot and new.block_hash_seed != old.block_hash_seed


def test_registry_without_lora():
    with pytest.raises(LoraError, match="--enable-lora"):
        LoraRegistry(0).add("a", "/nowhere")


def test_block_hash_chains_are_seeded_by_the_adapter():
    # The block manager alone: equal tokens under different seeds name different blocks.
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    card = LoraCard("a", "/a", None, slot=0, block_hash_seed=b"seed-a")
    base = Request("base", tokens, PARAMS, ())
    prefill(bm, base)
    adapted = Request("lora", tokens, PARAMS, (), lora=card)
    assert bm.find_cached_prefix(adapted) == []
    prefill(bm, adapted)
    assert adapted.block_hashes[0] != base.block_hashes[0]
    again = Request("lora-2", tokens, PARAMS, (), lora=card)
    assert bm.find_cached_prefix(again) == adapted.block_ids[:2]


def test_engine_client_loads_and_unloads_on_the_engine_thread(tiny_model_factory, tiny_lora_factory):
    directory, _ = tiny_model_factory("llama", False)
    engine = _engine(directory, {})
    # Generation holds still after the first token until the refused unload is seen: with 3 tokens to go, a
    # busy machine could otherwise let the engine finish them before the unload reaches it.
    resumed = threading.Event()
    resumed.set()
    real_step = engine.step

    def step():
        if not resumed.wait(0.01):
            return []  # back to the client's loop, which handles commands between steps
        outputs = real_step()
        if any(o.request_id == "r" and o.num_output_tokens == 1 for o in outputs):
            resumed.clear()
        return outputs

    engine.step = step
    client = EngineClient(engine)
    path = tiny_lora_factory("partial")[0]

    async def scenario() -> None:
        assert client.loras == {}
        with pytest.raises(UnknownLoraError):
            await anext(client.generate("early", PROMPT, PARAMS, lora_name="partial"))
        card = await client.load_lora("partial", path, "tiny")
        assert client.loras == {"partial": card} and card.base_model_name == "tiny"
        with pytest.raises(LoraError, match="no adapter_config.json"):
            await client.load_lora("bad", "/nonexistent")
        with pytest.raises(LoraError, match="already loaded"):
            await client.load_lora("partial", path)
        outputs = client.generate("r", PROMPT, PARAMS, lora_name="partial")
        first = await anext(outputs)  # the request is running now
        with pytest.raises(LoraConflictError):
            await client.unload_lora("partial")
        resumed.set()
        tokens = list(first.new_token_ids)
        async for output in outputs:
            tokens += output.new_token_ids
        assert len(tokens) == PARAMS.max_tokens
        await client.unload_lora("partial")
        assert client.loras == {}
        with pytest.raises(UnknownLoraError):
            await client.unload_lora("partial")

    try:
        asyncio.run(scenario())
        assert client.stats().num_free_blocks == client.stats().num_total_blocks
    finally:
        client.shutdown()
