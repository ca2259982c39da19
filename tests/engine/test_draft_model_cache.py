"""The draft model's own KV cache (engine/speculation/draft_model.py), on the default model drafting for itself:
it catches up with a sequence in one-token decode rows, a repeated prompt finds its prefix in the draft's
prefix cache (the draft computes only the rest), rejected drafts are never named there, and every draft block
comes back when the requests end."""

from __future__ import annotations

import pytest

from serval import LLM, SamplingParams
from serval.engine.block_manager import hash_block
from serval.engine.request import Request
from serval.model_source import resolve_model
from tests.engine.test_speculative_decoding import COPY, SPEC_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def drafted():
    path = resolve_model(None).path
    return LLM(speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 4,
                                   "max_num_seqs": 8})  # fmt: skip


@pytest.fixture
def draft_batches(drafted):
    """The new-token counts of every batch the draft runs, while the test runs."""
    runner = drafted.engine.speculator.proposer.runner
    execute, batches = runner.execute, []

    def recording(batch, *args, **kwargs):
        batches.append(list(batch.num_new_tokens))
        return execute(batch, *args, **kwargs)

    runner.execute = recording
    yield batches
    runner.execute = execute


def _draft_blocks(llm):
    return llm.engine.speculator.proposer.blocks


def test_catching_up_goes_in_decode_rows_and_a_repeated_prompt_hits_the_draft_prefix_cache(
    drafted, draft_batches
):
    first = drafted.generate([COPY], GREEDY)[0]
    prompt_len = len(first.prompt_token_ids)
    # The first drafting step (after the target's first token) works through the prompt and that token in one
    # chunk; after it, every batch is decode rows (the catching up of the kept drafts and the target's token,
    # then the drafts one a position).
    assert draft_batches[0] == [prompt_len + 1]
    assert all(set(batch) == {1} for batch in draft_batches[1:])
    assert any(len(batch) > 1 for batch in draft_batches[1:])  # catching up more than one token: several rows
    hits_before = _draft_blocks(drafted).num_hit_tokens
    draft_batches.clear()
    again = drafted.generate([COPY], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    block_size = _draft_blocks(drafted).block_size
    # Found in the draft's prefix cache: the prompt's full blocks (and the first answer's, for the same
    # answer), all but the last token at least a block short of the prompt computed again.
    assert _draft_blocks(drafted).num_hit_tokens - hits_before >= (prompt_len - 1) // block_size * block_size
    assert sum(draft_batches[0]) <= block_size


def test_only_kept_tokens_are_named_and_every_draft_block_comes_back(drafted):
    # Sampled at temperature 1 the target often rejects the draft's argmax: rollbacks in the draft cache.
    sampled = [SamplingParams(temperature=1.0, max_tokens=40, seed=seed) for seed in range(len(SPEC_PROMPTS))]
    blocks = _draft_blocks(drafted)
    counters = drafted.engine.speculator.counters
    num_drafts, num_accepted = counters.num_draft_tokens, counters.num_accepted_tokens
    names_before = set(blocks.cached_blocks)
    outputs = drafted.generate(SPEC_PROMPTS, sampled)
    assert counters.num_accepted_tokens - num_accepted < counters.num_draft_tokens - num_drafts  # rejections
    assert blocks.num_free_blocks == blocks.num_blocks
    # Every block the draft's cache named meanwhile is a block of some request's prompt and kept answer.
    kept_names = set().union(
        *(_names(o.prompt_token_ids + o.outputs[0].token_ids, blocks.block_size) for o in outputs)
    )
    new_names = set(blocks.cached_blocks) - names_before
    assert new_names and new_names <= kept_names


def _names(tokens: list[int], block_size: int) -> set[bytes]:
    names, parent = set(), b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        names.add(parent)
    return names


def test_drafts_stay_unnamed_until_kept_and_rejected_ones_are_forgotten(drafted):
    """The proposer driven directly: the drafts of a 30-token context complete its second block, which must
    not be named until the target keeps them; after a rejection the draft's cache names only real tokens."""
    proposer = drafted.engine.speculator.proposer
    blocks = proposer.blocks
    assert blocks.block_size == 16
    request = Request("direct", [100 + i for i in range(30)], SamplingParams(max_tokens=8), ())
    names_before = set(blocks.cached_blocks)
    proposer.prepare([(request, 4)])
    drafts = proposer.propose(request, 4)
    assert len(drafts) == 4
    assert set(blocks.cached_blocks) - names_before <= _names(request.token_ids, 16)  # the first block only
    # The target keeps the first draft and samples another token in place of the second.
    request.token_ids.extend([drafts[0], (drafts[1] + 1) % 1000])
    proposer.prepare([(request, 4)])
    assert set(blocks.cached_blocks) - names_before <= _names(request.token_ids, 16)
    sequence = proposer.sequences["direct"]
    assert sequence.token_ids[: len(request.token_ids)] == request.token_ids
    proposer.forget(request)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_request_far_into_its_answer_is_not_taken_up(drafted):
    """A stream that first asks for drafts long after its answer began (left alone at the end of a busy spell)
    gets none: catching up its whole context would cost more than its last tokens can save."""
    proposer = drafted.engine.speculator.proposer
    request = Request("late", [100 + i for i in range(30)], SamplingParams(max_tokens=64), ())
    request.token_ids.extend(range(200, 220))  # 20 tokens into its answer, unknown to the draft
    proposer.prepare([(request, 4)])
    assert proposer.propose(request, 4) == []
    assert "late" not in proposer.sequences
    early = Request("early", [100 + i for i in range(30)], SamplingParams(max_tokens=64), ())
    early.token_ids.append(200)
    proposer.prepare([(early, 4)])
    assert len(proposer.propose(early, 4)) == 4
    proposer.forget(early)
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
