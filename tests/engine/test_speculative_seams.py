"""The seams of speculative decoding composed by hand on a real engine (a tiny fp32 model): score a
sequence's drafts in one step, accept the greedy prefix, roll back the rest, and let the engine go on. The
answer is the plain engine's greedy answer, which holds only if the scored rows are the decode steps' and the
rolled-back KV rows are written over, not read."""

from __future__ import annotations

from serval.config import CacheConfig, EngineConfig, ModelConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch
from serval.sampling import SamplingParams

PROMPT = [5, 17, 260, 3, 3, 99, 41, 8]  # two full blocks of 4: the drafts start a third
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(tiny_model_factory) -> Engine:
    directory, _ = tiny_model_factory("llama", False)
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype="float32"),
            cache=CacheConfig(num_blocks=32, block_size=4),
        )
    )


def _finish(engine: Engine) -> list[int]:
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
    return tokens


def test_a_hand_made_speculative_step_keeps_the_greedy_answer(tiny_model_factory):
    plain = _engine(tiny_model_factory)
    plain.add_request("r", PROMPT, PARAMS)
    expected = _finish(plain)

    engine = _engine(tiny_model_factory)
    engine.add_request("r", PROMPT, PARAMS)
    (first,) = engine.step()  # the prefill samples the first token
    request, blocks = engine.requests["r"], engine.block_manager
    # Two right drafts, then two wrong ones: positions 8..12, the third block filled and a fourth begun.
    drafts = expected[1:3] + [(expected[3] + 1) % 300, 7]
    num_computed = request.num_computed_tokens
    for token_id in drafts:
        request.append_token(token_id)
    num_new = request.num_tokens - num_computed
    blocks.allocate(request, num_new)
    step = Batch(request.token_ids[num_computed:], [num_new], [num_computed], [list(request.block_ids)], [0], [],
                 block_copies=blocks.take_copies(), num_logit_rows=[num_new])  # fmt: skip
    (logits,) = engine.runner.score(step)
    request.num_computed_tokens = request.num_tokens
    blocks.cache_full_blocks(request, num_provisional_tokens=len(drafts))
    assert len(request.block_hashes) == 2  # the third block is full of drafts: not named yet

    greedy = logits.argmax(-1).tolist()
    assert greedy[:3] == expected[1:4]  # the rows up to the first wrong draft follow the answer
    num_accepted = next(i for i, (d, g) in enumerate(zip(drafts, greedy)) if d != g)
    assert num_accepted == 2
    num_rejected = len(drafts) - num_accepted
    blocks.rollback(request, num_rejected)  # back into the third block: its last row is rewritten next
    request.rollback_tokens(num_rejected)
    blocks.cache_full_blocks(request)
    request.append_token(greedy[num_accepted])  # the token the first rejected row chose
    assert len(request.block_ids) == 3 and blocks.num_free_blocks == blocks.num_blocks - 3

    rest = _finish(engine)
    assert first.new_token_ids + drafts[:num_accepted] + [greedy[num_accepted]] + rest == expected
    assert blocks.num_free_blocks == blocks.num_blocks
