"""Prompt lookup (engine/speculation/ngram.py): the continuation of the latest earlier occurrence of the
longest suffix that occurred before, within the n-gram bounds."""

from __future__ import annotations

import random

import pytest

from serval.engine.speculation.ngram import NgramProposer


def _reference(token_ids: list[int], max_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The rule written plainly: longest n first, then the latest start."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + max_drafts]
    return []


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    tokens = [1, 2, 3, 4, 5, 9, 9, 3, 4, 7, 7, 2, 3, 4]
    # "2 3 4" occurred at 1..3 (followed by 5 9 9); "3 4" occurred later at 7..8 (followed by 7 7).
    assert NgramProposer(2, 3).lookup(tokens, 3) == [5, 9, 9]
    assert NgramProposer(2, 2).lookup(tokens, 3) == [7, 7, 2]


def test_the_latest_occurrence_wins_among_equals():
    tokens = [8, 1, 2, 5, 8, 1, 2, 6, 8, 1, 2]
    assert NgramProposer(1, 3).lookup(tokens, 2) == [6, 8]


def test_nothing_when_no_suffix_repeats_or_nothing_is_wanted():
    assert NgramProposer(1, 4).lookup([1, 2, 3, 4], 4) == []
    assert NgramProposer(2, 4).lookup([1, 2, 3, 1], 4) == []  # only a 1-gram repeats
    assert NgramProposer(1, 4).lookup([1, 2, 1], 0) == []
    assert NgramProposer(1, 4).lookup([7], 3) == []


def test_a_continuation_may_run_into_the_suffix_itself():
    # A period of 2: the latest earlier "1 2" starts two back, and its continuation is the suffix.
    assert NgramProposer(2, 2).lookup([1, 2, 1, 2], 5) == [1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_the_plain_rule_on_random_sequences(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 200))]
    min_n = rng.randrange(1, 4)
    max_n = rng.randrange(min_n, 6)
    max_drafts = rng.randrange(1, 8)
    assert NgramProposer(min_n, max_n).lookup(tokens, max_drafts) == _reference(
        tokens, max_drafts, min_n, max_n
    )
