"""TokenConstraint.rollback, the grammar seam of speculative decoding, on the byte tokenizer: a constraint that
accepted t1..tn and rolled back k allows exactly what a fresh one that accepted t1..t(n-k) allows, and is
finished exactly when it is; for xgrammar's matcher and for the thinking budget (its forced end tag undone,
with and without a grammar inside, with <think> and with harmony's counter); past the window, a ValueError."""

from __future__ import annotations

import pytest

from serval.engine.constraint import MAX_ROLLBACK_TOKENS
from serval.serving.chat import ChatOptions, ResponseFormat, grammar_spec
from serval.serving.harmony import HarmonyReasoningCounter, budget_end
from serval.serving.reasoning import ThinkingBudget
from serval.serving.structured import GrammarCompiler
from serval.serving.tool_calls import FORMATS
from tests.serving.fakes import ByteTokenizer
from tests.serving.test_structured import SCHEMA, random_walk

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids[0]
THINK_END_IDS = TOKENIZER.encode("\n</think>\n\n")


@pytest.fixture(scope="module")
def json_grammar():
    options = ChatOptions(response_format=ResponseFormat("json_schema", SCHEMA))
    return GrammarCompiler(ByteTokenizer()).compile_now(grammar_spec(options, FORMATS["hermes"], "none"))


@pytest.fixture(scope="module")
def reasoning_grammar():
    options = ChatOptions(response_format=ResponseFormat("json_schema", SCHEMA))
    return GrammarCompiler(ByteTokenizer()).compile_now(grammar_spec(options, FORMATS["hermes"], "open"))


def state(constraint) -> tuple:
    """What the engine reads of a constraint: the allowed tokens and whether it is finished (a finished one
    is never asked for its mask: xgrammar's refuses to give one)."""
    if constraint.is_finished:
        return (None, True)
    bitmask = constraint.allowed_token_bitmask()
    return (None if bitmask is None else bitmask.tolist(), constraint.is_finished)


def accepted(make, token_ids: list[int]):
    constraint = make()
    for token_id in token_ids:
        constraint.accept_token(token_id)
    return constraint


def assert_rollbacks_match_fresh(make, token_ids: list[int], window: int = MAX_ROLLBACK_TOKENS) -> None:
    """For every k the window allows: accept all, roll back k == accept all but the last k; and rolling
    back one at a time, then accepting the same tokens again, ends where it started."""
    for k in range(min(window, len(token_ids)) + 1):
        constraint = accepted(make, token_ids)
        constraint.rollback(k)
        expected = accepted(make, token_ids[: len(token_ids) - k])
        assert state(constraint) == state(expected), k
    constraint = accepted(make, token_ids)
    end_state = state(constraint)
    num_back = min(window, len(token_ids))
    for k in range(num_back):
        constraint.rollback(1)
        assert state(constraint) == state(accepted(make, token_ids[: len(token_ids) - k - 1])), k
    for token_id in token_ids[len(token_ids) - num_back :]:
        constraint.accept_token(token_id)
    assert state(constraint) == end_state


def test_grammar_rollback_equals_a_fresh_matcher(json_grammar):
    ids = random_walk(json_grammar.new_constraint(), seed=2)
    assert ids[-1] == EOS and len(ids) > MAX_ROLLBACK_TOKENS  # the walk ended the grammar
    assert_rollbacks_match_fresh(json_grammar.new_constraint, ids)
    constraint = accepted(json_grammar.new_constraint, ids)
    assert constraint.is_finished
    constraint.rollback(1)  # the end of generation was a rejected draft: the JSON may go on (or end)
    assert not constraint.is_finished and EOS in allowed(constraint)


def test_grammar_rollback_undoes_a_rejected_token(json_grammar):
    constraint = json_grammar.new_constraint()
    constraint.accept_token(ord("{"))
    before = state(constraint)
    constraint.accept_token(ord("x"))  # not JSON: the matcher refuses it and the request would end
    assert constraint.is_finished
    constraint.rollback(1)
    assert state(constraint) == before and not constraint.is_rejected
    constraint.accept_token(ord('"'))  # and it goes on from before the refused token
    assert state(constraint) == state(accepted(json_grammar.new_constraint, [ord("{"), ord('"')]))
    constraint.accept_token(ord("\\"))  # a backslash, then a character JSON does not escape: refused
    constraint.accept_token(ord("q"))
    assert constraint.is_rejected
    constraint.rollback(3)  # the refused token left the matcher where it was: only two steps to undo
    assert state(constraint) == before


def allowed(constraint) -> list[int]:
    bits = constraint.allowed_token_bitmask()
    return [t for t in range(TOKENIZER.vocab_size) if bits[t // 32] >> (t % 32) & 1]


def think_budget(inner_grammar=None, window: int = MAX_ROLLBACK_TOKENS):
    def make():
        inner = inner_grammar.new_constraint() if inner_grammar is not None else None
        return ThinkingBudget(
            5, THINK_END_IDS, TOKENIZER.token_bytes, TOKENIZER.vocab_size, True, inner,
            max_rollback_tokens=window,
        )  # fmt: skip

    return make


def test_thinking_budget_rollback_undoes_the_forced_end_tag(reasoning_grammar):
    make = think_budget(reasoning_grammar)
    ids = random_walk(make(), seed=3)
    assert ids[5 : 5 + len(THINK_END_IDS)] == THINK_END_IDS  # forced after the five free tokens
    # Around the forcing: the fifth free token starts it, the tag's tokens run it out.
    for end in range(4, 5 + len(THINK_END_IDS) + 3):
        assert_rollbacks_match_fresh(make, ids[:end])
    budget = accepted(make, ids[:7])  # five free tokens, then two of the forced tag
    assert budget.forced == THINK_END_IDS[2:]
    budget.rollback(3)  # back to four free tokens: nothing forced, the reasoning counted 4
    assert budget.forced == [] and budget.counter.num_reasoning_tokens == 4
    assert len(allowed(budget)) > 1
    assert_rollbacks_match_fresh(make, ids)  # and over the whole walk, the JSON's end included


def test_thinking_budget_rollback_after_the_checkpoint_moved():
    # A window of 3 over 40 tokens: the replayed copy moves forward many times; no grammar inside.
    make = think_budget(window=3)
    ids = list(b"abcde") + THINK_END_IDS + list(b'{"name": "x", "age": 3}')
    for end in range(len(ids) + 1):
        assert_rollbacks_match_fresh(make, ids[:end], window=3)
        budget, fresh = accepted(make, ids[:end]), accepted(make, ids[: max(0, end - 3)])
        budget.rollback(min(3, end))
        assert budget.counter.num_reasoning_tokens == fresh.counter.num_reasoning_tokens
        assert budget.counter.is_reasoning == fresh.counter.is_reasoning


def test_harmony_thinking_budget_rollback():
    end_ids = list(budget_end(False).encode())

    def make():
        return ThinkingBudget(
            5, end_ids, TOKENIZER.token_bytes, TOKENIZER.vocab_size, False, None, HarmonyReasoningCounter()
        )

    # The token that completes <|message|> counts: "hell" is the fifth reasoning token, and starts the forcing.
    ids = list(b"<|channel|>analysis<|message|>hell") + end_ids[:6]
    budget = accepted(make, ids)
    assert budget.forced == end_ids[6:] and budget.counter.num_reasoning_tokens == 5 + 6
    budget.rollback(7)  # the fifth reasoning token and the six forced ones
    assert budget.forced == [] and budget.counter.num_reasoning_tokens == 4
    assert_rollbacks_match_fresh(make, ids)


@pytest.mark.parametrize("kind", ["grammar", "budget", "budget_around_grammar"])
def test_rolling_back_past_the_window_or_the_start_is_refused(json_grammar, reasoning_grammar, kind):
    make = {
        "grammar": json_grammar.new_constraint,
        "budget": think_budget(window=4),
        "budget_around_grammar": think_budget(reasoning_grammar, window=4),
    }[kind]
    window = MAX_ROLLBACK_TOKENS if kind == "grammar" else 4
    ids = random_walk(json_grammar.new_constraint(), seed=1)[: window + 6]
    constraint = accepted(make, ids[:2])
    with pytest.raises(ValueError, match="only 2 were accepted"):
        constraint.rollback(3)
    constraint = accepted(make, ids)
    before = state(constraint)
    with pytest.raises(ValueError, match=f"at most the last {window} .max_rollback_tokens."):
        constraint.rollback(window + 1)
    assert state(constraint) == before  # a refused rollback changes nothing
    constraint.rollback(window)
    assert state(constraint) == state(accepted(make, ids[:-window]))
    with pytest.raises(ValueError, match="negative"):
        constraint.rollback(-1)
