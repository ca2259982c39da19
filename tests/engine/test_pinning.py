"""Explicit prompt caching: pinned blocks survive eviction for five minutes of an injected clock, within a bound.

The BlockManager part runs on token ids alone; the engine part on a tiny random-weight model, where a flood of
other requests would evict an unpinned prefix.
"""

from __future__ import annotations

import pytest

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.block_manager import PIN_TTL_S, BlockManager
from serval.engine.engine import Engine
from serval.sampling import SamplingParams
from tests.engine.block_helpers import make_request, prefill


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fill(bm: BlockManager, start: int, count: int = 2) -> None:
    # Requests of fresh tokens as long as the free list allows: each one takes (evicts) every free block.
    for i in range(count):
        num_tokens = bm.num_free_blocks * bm.block_size
        r = make_request(f"fill{start + i}", [1000 * (start + i) + t for t in range(num_tokens)])
        prefill(bm, r)
        bm.free(r)


def test_pinned_blocks_survive_eviction_until_they_expire():
    clock = FakeClock()
    bm = BlockManager(num_blocks=8, block_size=2, max_num_pinned_blocks=4, clock=clock)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks and a partial one
    prefill(bm, a)
    assert bm.pin(a, 5) == 4  # the full blocks inside the first 5 tokens: 2
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_pinned_blocks == 2
    _fill(bm, 1)
    again = make_request("a2", [1, 2, 3, 4, 9])
    assert len(bm.find_cached_prefix(again)) == 2

    clock.now += PIN_TTL_S - 1
    assert bm.release_expired_pins() == 0
    clock.now += 1
    assert bm.release_expired_pins() == 2
    assert bm.num_free_blocks == 8 and bm.num_pinned_blocks == 0
    _fill(bm, 10)
    assert bm.find_cached_prefix(again) == []


def test_repinning_refreshes_and_counts_nothing_new():
    clock = FakeClock()
    bm = BlockManager(num_blocks=8, block_size=2, max_num_pinned_blocks=4, clock=clock)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.pin(a, 4) == 4
    bm.free(a)
    clock.now += PIN_TTL_S - 10
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])  # the same two blocks, then one more
    prefill(bm, b)
    assert bm.pin(b, 6) == 2  # only the third block is new; the first two are refreshed
    bm.free(b)
    clock.now += 20  # past a's first expiry, inside the refreshed one
    assert bm.release_expired_pins() == 0
    assert bm.num_pinned_blocks == 3


def test_pins_stop_at_the_bound_and_keep_older_pins():
    clock = FakeClock()
    bm = BlockManager(num_blocks=16, block_size=2, max_num_pinned_blocks=3, clock=clock)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.pin(a, 4) == 4
    b = make_request("b", [9, 8, 7, 6, 5, 4, 3])
    prefill(bm, b)
    assert bm.pin(b, 6) == 2  # one block left under the bound: b's first; the rest are refused
    assert bm.num_pinned_blocks == 3 and bm.num_refused_pin_blocks == 2
    bm.free(a)
    bm.free(b)
    # Pins hold their blocks whatever happens: the free list never holds them.
    assert bm.num_free_blocks == 13
    assert all(block_id not in bm.free_blocks for block_id in bm.pin_expiry)


def test_without_prefix_caching_nothing_is_pinned():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False, max_num_pinned_blocks=4)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.pin(a, 4) == 0 and bm.num_pinned_blocks == 0


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 2.0])
def test_pinned_fraction_is_validated(fraction):
    with pytest.raises(ValueError, match="max_pinned_kv_fraction"):
        CacheConfig(max_pinned_kv_fraction=fraction)


# ---- the engine, on a tiny model

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def _run(engine: Engine, prompts: dict[str, list[int]], num_pinned: int = 0) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params, num_pinned_prompt_tokens=num_pinned)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def _flood(engine: Engine, tag: int) -> None:
    # 8 prompts of 40 fresh tokens: far more than the 32 blocks of 4, so every unpinned block is reused.
    prompts = {f"flood{tag}-{i}": [(7 * tag + 40 * i + t) % 300 + 10 for t in range(40)] for i in range(8)}
    _run(engine, prompts)


def test_pinned_prefix_survives_a_flood_and_expires(tiny_model_factory):
    directory, _ = tiny_model_factory("llama")
    clock = FakeClock()
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_pinned_kv_fraction=0.25),
    )
    engine = Engine(config, clock=clock)
    prefix = [300 + t % 50 for t in range(16)]
    first = _run(engine, {"a": prefix + [5, 6, 7]}, num_pinned=16)["a"]
    assert first.num_newly_pinned_tokens == 16 and first.num_cached_tokens == 0
    assert engine.block_manager.num_pinned_blocks == 4

    _flood(engine, 1)
    hit = _run(engine, {"b": prefix + [8, 9]}, num_pinned=16)["b"]
    assert hit.num_cached_tokens == 16
    assert hit.num_newly_pinned_tokens == 0  # refreshed, not written

    clock.now += PIN_TTL_S + 1
    _flood(engine, 2)  # its first step drops the expired pins; the flood then evicts the blocks
    assert engine.block_manager.num_pinned_blocks == 0
    miss = _run(engine, {"c": prefix + [8, 9]})["c"]
    assert miss.num_cached_tokens == 0
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_the_context_limit_leaves_room_beside_the_pins(tiny_model_factory):
    directory, _ = tiny_model_factory("llama")
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_pinned_kv_fraction=0.25),
    )
    engine = Engine(config)
    assert engine.max_model_len == (NUM_BLOCKS - NUM_BLOCKS // 4) * BLOCK_SIZE
    with pytest.raises(ValueError, match="num_pinned_prompt_tokens"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), num_pinned_prompt_tokens=4)
