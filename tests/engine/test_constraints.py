"""TokenConstraints in the engine, on a tiny random-weight model: masks are obeyed in a shared batch, every
sampled token is accepted exactly once even across preemption, and a finished constraint stops the request."""

from __future__ import annotations

import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.sampling import SamplingParams


class AllowedSet:
    """Allows a fixed set of ids; records what it was told; finishes after `limit` tokens if given."""

    def __init__(self, allowed: list[int], num_words: int, limit: int | None = None) -> None:
        words = [0] * num_words
        for token_id in allowed:
            words[token_id // 32] |= 1 << (token_id % 32)
        self.bitmask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
        self.accepted: list[int] = []
        self.limit = limit

    def allowed_token_bitmask(self) -> torch.Tensor:
        return self.bitmask

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.limit is not None and len(self.accepted) >= self.limit


def _run(engine: Engine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finish[output.request_id] = output.finish_reason
    return outputs, finish


def test_masks_hold_in_a_mixed_batch_and_survive_preemption(tiny_model_factory):
    directory, _ = tiny_model_factory("llama")
    # 12 blocks of 4 tokens cannot hold 6 sequences of 8 + 12 tokens: the scheduler must preempt.
    config = EngineConfig(
        model=ModelConfig(model=directory, dtype="float32"),
        cache=CacheConfig(num_blocks=12, block_size=4, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64),
    )
    engine = Engine(config)
    num_words = (engine.runner.info.vocab_size + 31) // 32
    constraints = {}
    for i in range(6):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True)
        constraint = AllowedSet([10 + i, 50 + i, 200 + i], num_words) if i % 2 == 0 else None
        constraints[str(i)] = constraint
        engine.add_request(str(i), list(range(20 + i, 28 + i)), params, constraint=constraint)
    outputs, _ = _run(engine)
    assert engine.num_preemptions > 0
    for request_id, constraint in constraints.items():
        assert len(outputs[request_id]) == 12
        if constraint is not None:
            i = int(request_id)
            assert set(outputs[request_id]) <= {10 + i, 50 + i, 200 + i}
            assert constraint.accepted == outputs[request_id]  # once each, in order, despite recompute


def test_a_finished_constraint_stops_the_request(tiny_model_factory):
    directory, _ = tiny_model_factory("llama")
    engine = Engine(
        EngineConfig(model=ModelConfig(model=directory, dtype="float32"), cache=CacheConfig(num_blocks=16))
    )
    num_words = (engine.runner.info.vocab_size + 31) // 32
    constraint = AllowedSet([7], num_words, limit=3)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=20), constraint=constraint)
    outputs, finish = _run(engine)
    assert outputs["r"] == [7, 7, 7] and finish["r"] == "stop"
