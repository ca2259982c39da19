"""Speculative decoding on the default model (SmolLM2-135M-Instruct Q4_1, its default numerics, which give a
token the same bits whichever step computes it): with n-gram drafts or a draft model, greedy answers and their
logprobs are those of plain decoding, alone and batched, with stops, token caps, penalties and a prefix-cache
hit; the drafts really are proposed and accepted; every KV block comes back, and the prefix cache names
exactly the blocks plain decoding names.

Every test leaves every KV block free; the fixture checks it after each test.
"""

from __future__ import annotations

import pytest

from serval import LLM, SamplingParams
from serval.model_source import resolve_model
from tests.fixtures.prompts import PROMPTS

PASSAGE = (
    "The serval is a wild cat native to Africa. It is rarely found in rainforest and across the Sahara, but "
    "occurs in all other vegetation zones. It has a small head, large ears, a golden-yellow to buff coat "
    "spotted and striped with black, and a short, black-tipped tail."
)
COPY = f"<|im_start|>user\nRepeat this text exactly:\n{PASSAGE}<|im_end|>\n<|im_start|>assistant\n"
LIST = "<|im_start|>user\nCount from 1 to 30, separated by commas.<|im_end|>\n<|im_start|>assistant\n"
SPEC_PROMPTS = [COPY, LIST, *PROMPTS[:6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, logprobs=2)


@pytest.fixture(scope="module")
def plain():
    return LLM()


@pytest.fixture(scope="module")
def ngram():
    return LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                   "max_num_seqs": 8})  # fmt: skip


@pytest.fixture(scope="module")
def ngram_wide():
    # Adaptive draft lengths up to 15 (the default is adaptive): copying grows them past 4.
    return LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_min": 1,
                                   "max_num_seqs": 8})  # fmt: skip


@pytest.fixture(scope="module")
def ngram_fixed():
    return LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
                                   "max_num_seqs": 8, "adaptive_draft_length": False})  # fmt: skip


@pytest.fixture(scope="module")
def drafted():
    # The served model's own file drafting for it: the machinery under test is the catching up, the block
    # handling and the settling, whatever the draft's quality.
    path = resolve_model(None).path
    return LLM(speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                                   "max_num_seqs": 8})  # fmt: skip


@pytest.fixture(autouse=True)
def all_blocks_free_after(request):
    yield
    for name in ("plain", "ngram", "ngram_wide", "ngram_fixed", "drafted"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name).engine
            assert not engine.has_unfinished_requests()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _answers(llm, prompts, params=GREEDY):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _tokens_and_logprobs(outputs):
    return [(o.token_ids, [(e.token_id, e.logprob, e.top) for e in o.logprobs]) for o in outputs]


def _counters(llm):
    return llm.engine.speculator.counters


@pytest.mark.parametrize("speculative", ["ngram", "ngram_wide", "ngram_fixed", "drafted"])
def test_greedy_answers_and_logprobs_are_plain_decodings_alone_and_batched(plain, speculative, request):
    llm = request.getfixturevalue(speculative)
    expected = _tokens_and_logprobs(_answers(plain, SPEC_PROMPTS))
    before = _counters(llm).num_accepted_tokens
    batched = _tokens_and_logprobs(_answers(llm, SPEC_PROMPTS))
    alone = [_tokens_and_logprobs(_answers(llm, [p]))[0] for p in SPEC_PROMPTS[:3]]
    assert batched == expected
    assert alone == expected[:3]
    assert _counters(llm).num_accepted_tokens - before > 40  # it did speculate, and drafts were kept


def test_adaptive_lengths_grow_past_four_while_copying_and_keep_plain_decodings_answer(plain, ngram_wide):
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)
    expected = _tokens_and_logprobs(_answers(plain, [COPY], params))
    before = list(_counters(ngram_wide).accepted_per_position)
    assert _tokens_and_logprobs(_answers(ngram_wide, [COPY], params)) == expected
    kept_per_position = [a - b for a, b in zip(_counters(ngram_wide).accepted_per_position, before)]
    assert sum(kept_per_position[4:]) > 0  # drafts past the fourth were asked for, and kept


def test_copying_takes_fewer_steps_than_tokens(plain, ngram):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    steps = ngram.engine.num_steps
    [answer] = _answers(ngram, [COPY], params)
    num_steps = ngram.engine.num_steps - steps
    assert answer.token_ids == _answers(plain, [COPY], params)[0].token_ids
    assert num_steps < len(answer.token_ids) / 2  # the passage's tokens come several a step


def test_a_stop_token_inside_the_accepted_drafts_ends_the_answer_there(plain, ngram):
    [full] = _answers(plain, [LIST], SamplingParams(temperature=0.0, max_tokens=40))
    stop_id = full.token_ids[20]  # a token met mid-answer, where drafts are long and accepted
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id])
    [expected] = _answers(plain, [LIST], params)
    [answer] = _answers(ngram, [LIST], params)
    assert answer.token_ids == expected.token_ids
    assert answer.finish_reason == expected.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 23])
def test_the_token_cap_holds_exactly(plain, ngram, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    [expected] = _answers(plain, [COPY], params)
    [answer] = _answers(ngram, [COPY], params)
    assert answer.token_ids == expected.token_ids
    assert len(answer.token_ids) == max_tokens and answer.finish_reason == "length"


def test_penalties_and_min_tokens_see_the_drafts_before_each_row(plain, ngram):
    params = SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.4, repetition_penalty=1.1,
                            presence_penalty=0.2, min_tokens=30, logit_bias={11: 2.0})  # fmt: skip
    expected = [o.token_ids for o in _answers(plain, [COPY, LIST], params)]
    assert [o.token_ids for o in _answers(ngram, [COPY, LIST], params)] == expected


def test_a_request_may_opt_out(ngram):
    before = _counters(ngram).num_drafts
    _answers(ngram, [COPY], SamplingParams(temperature=0.0, max_tokens=32, speculative=False))
    assert _counters(ngram).num_drafts == before


def test_the_prefix_cache_names_what_plain_decoding_names(plain, ngram):
    # A prompt neither engine has seen: the blocks each names for it are new names.
    prompt = COPY.replace("Repeat", "Please repeat")
    params = SamplingParams(temperature=0.0, max_tokens=70)
    new_names, answers = [], []
    for llm in (plain, ngram):
        before = set(llm.engine.block_manager.cached_blocks)
        answers.append(_answers(llm, [prompt], params)[0].token_ids)
        new_names.append(set(llm.engine.block_manager.cached_blocks) - before)
    assert answers[0] == answers[1]
    # Rejected drafts were computed into blocks, and none of them got a name: the names are plain decoding's.
    assert new_names[0] == new_names[1]
    # Every block full of computed tokens (all but the last token) is named.
    assert len(new_names[0]) == (len(plain.tokenizer.encode(prompt)) + len(answers[0]) - 1) // 16


def test_batches_past_the_threshold_decode_a_token_a_step(ngram):
    # More running sequences than max_num_seqs: nobody speculates, answers unchanged.
    before = _counters(ngram).num_drafts
    _answers(ngram, [COPY] * 9, SamplingParams(temperature=0.0, max_tokens=4))
    assert _counters(ngram).num_drafts == before
