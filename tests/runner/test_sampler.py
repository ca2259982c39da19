"""Sampler: each transform of the logits does what its parameter says, row by row, in one batch."""

from __future__ import annotations

import math

import torch

from serval.runner.batch import SamplingRow
from serval.runner.sampler import Sampler


def _row(**kw) -> SamplingRow:
    base = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "num_logprobs": None,
        "generator": None,
    }
    base.update(kw)
    return SamplingRow(**base)


def _sampler(seed=0) -> Sampler:
    g = torch.Generator()
    g.manual_seed(seed)
    return Sampler(g)


def _draw_many(logits_row: torch.Tensor, row_kw: dict, n: int = 400) -> set[int]:
    sampler = _sampler()
    rows = [_row(**row_kw) for _ in range(n)]
    return set(sampler(logits_row.repeat(n, 1), rows).token_ids)


def test_greedy_takes_argmax_regardless_of_other_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    out = _sampler()(logits, [_row(temperature=0.0), _row(temperature=1.0)])
    assert out.token_ids[0] == 1


def test_top_k_keeps_only_k_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert _draw_many(logits, {"top_k": 2}) == {0, 1}


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _draw_many(probs.log(), {"top_p": 0.7}) == {0, 1}
    assert _draw_many(probs.log(), {"top_p": 0.5}) == {0}


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _draw_many(probs.log(), {"min_p": 0.5}) == {0, 1}


def test_penalties_move_logits_as_defined():
    sampler = _sampler()
    logits = torch.zeros(1, 4)
    logits[0, 0] = 2.0
    rows = [_row(presence_penalty=1.0, frequency_penalty=0.5, output_token_ids=[1, 1])]
    out = sampler._apply_penalties(logits, rows)
    assert out[0].tolist() == [2.0, -2.0, 0.0, 0.0]  # token 1: -1 presence - 2*0.5 frequency
    rows = [_row(repetition_penalty=2.0, prompt_token_ids=[0], output_token_ids=[3])]
    logits = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
    assert sampler._apply_penalties(logits, rows)[0].tolist() == [1.0, 1.0, 1.0, -2.0]


def test_seeded_row_does_not_depend_on_its_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(5, 100)

    def seeded_draws(batch_logits, index):
        g = torch.Generator()
        g.manual_seed(1234)
        rows = [_row() for _ in range(batch_logits.shape[0])]
        rows[index] = _row(generator=g)
        draws = []
        for _ in range(20):
            draws.append(_sampler(seed=len(draws))(batch_logits, rows).token_ids[index])
        return draws

    alone = seeded_draws(logits[2:3], 0)
    in_batch = seeded_draws(logits, 2)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_are_raw_log_softmax_with_top_k():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    out = _sampler()(logits, [_row(temperature=0.0, num_logprobs=2)])
    expected = torch.log_softmax(logits, -1)[0]
    assert out.token_ids == [2]
    assert math.isclose(out.logprobs[0], expected[2].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1]


def test_banned_tokens_are_never_drawn():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    out = _sampler()(logits, [_row(temperature=0.0, banned_token_ids=[0])])
    assert out.token_ids[0] != 0


def _bitmask(allowed: list[int], num_words: int) -> torch.Tensor:
    words = [0] * num_words
    for token_id in allowed:
        words[token_id // 32] |= 1 << (token_id % 32)
    # int32 two's complement, as xgrammar lays it out
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_allowed_token_masks_apply_per_row_and_pad_a_wider_vocab():
    vocab_size = 100  # wider than the 64 ids (2 words) the masks cover
    logits = torch.randn(1, vocab_size)
    allowed = [3, 31, 63]
    mask = _bitmask(allowed, 2)
    assert _draw_many(logits[0], {"allowed_token_bitmask": mask}) <= set(allowed)
    assert _draw_many(logits[0], {"allowed_token_bitmask": mask, "temperature": 0.0}) <= set(allowed)
    # constrained and free rows share one batch
    out = _sampler()(
        logits.repeat(2, 1),
        [_row(temperature=0.0, allowed_token_bitmask=_bitmask([70], 3)), _row(temperature=0.0)],
    )
    assert out.token_ids == [70, int(logits.argmax())]


def test_a_grammar_outranks_a_ban_that_would_leave_nothing():
    logits = torch.randn(1, 40)
    out = _sampler()(logits, [_row(banned_token_ids=[5], allowed_token_bitmask=_bitmask([5], 2))])
    assert out.token_ids == [5]


def test_logit_bias_plus_100_forces_a_token():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 5
    target = int(logits[0].argmin())  # the least likely token
    bias = [(target, 100.0)]
    assert _sampler()(logits, [_row(temperature=0.0, logit_bias=bias)]).token_ids == [target]
    assert _draw_many(logits[0], {"logit_bias": bias}) == {target}  # sampled at temperature 1 too


def test_logit_bias_minus_100_bans_the_greedy_token():
    torch.manual_seed(1)
    logits = torch.randn(1, 50) * 5
    first, second = logits[0].topk(2).indices.tolist()
    out = _sampler()(logits, [_row(temperature=0.0, logit_bias=[(first, -100.0)])])
    assert out.token_ids == [second]
    assert first not in _draw_many(logits[0], {"logit_bias": [(first, -100.0)]})


def test_logit_bias_is_per_row_and_leaves_the_callers_logits_alone():
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0]]).repeat(3, 1)
    before = logits.clone()
    rows = [
        _row(temperature=0.0, logit_bias=[(2, 100.0)]),
        _row(temperature=0.0),
        _row(temperature=0.0, logit_bias=[(0, -100.0), (3, 1.5)]),
    ]
    assert _sampler()(logits, rows).token_ids == [2, 0, 3]
    assert torch.equal(logits, before)


def test_logprobs_include_the_bias_but_not_the_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    row = _row(temperature=0.5, num_logprobs=2, logit_bias=[(3, 10.0), (2, -1.5)])
    out = _sampler()(logits, [row])
    expected = torch.log_softmax(logits + torch.tensor([[0.0, 0.0, -1.5, 10.0]]), -1)[0]
    chosen = out.token_ids[0]
    assert math.isclose(out.logprobs[0], expected[chosen].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [3, 1]
    assert math.isclose(out.top_logprobs[0][0][1], expected[3].item(), rel_tol=1e-6)


def test_a_grammar_outranks_a_plus_100_bias():
    logits = torch.randn(1, 40)
    row = _row(temperature=0.0, logit_bias=[(7, 100.0)], allowed_token_bitmask=_bitmask([5, 9], 2))
    assert _sampler()(logits, [row]).token_ids[0] in (5, 9)
