"""StopMatcher: every text cut into pieces at every split point gives the one-shot answer."""

from __future__ import annotations

import itertools

import pytest

from serval.serving.stop import StopMatcher

CASES = [
    # (text, stop strings, include_stop_str_in_output, expected output, expected match)
    ("Hello world. Bye", ("world",), False, "Hello ", "world"),
    ("Hello world. Bye", ("world",), True, "Hello world", "world"),
    ("abcabd", ("abd",), False, "abc", "abd"),
    ("aaab", ("aab",), False, "a", "aab"),
    ("no stop here", ("xyz",), False, "no stop here", None),
    ("ends with a partial st", ("stop",), False, "ends with a partial st", None),
    ("two stops: B then A", ("A", "B"), False, "two stops: ", "B"),
    # The first stop string to be complete wins: "bc" is complete before "abcd" is.
    ("prefix overlap: abcd", ("bc", "abcd"), False, "prefix overlap: a", "bc"),
    ("same end: xabc", ("bc", "abc"), False, "same end: x", "abc"),
    ("héllo wörld", ("wö",), False, "héllo ", "wö"),
    ("line\n\nnext", ("\n\n",), False, "line", "\n\n"),
]


def run(pieces: list[str], stop: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    matcher = StopMatcher(stop, include)
    out = "".join(matcher.feed(piece) for piece in pieces)
    out += matcher.flush()
    return out, matcher.matched


@pytest.mark.parametrize("text, stop, include, expected, match", CASES)
def test_every_split_point(text, stop, include, expected, match):
    assert run([text], stop, include) == (expected, match)
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]], stop, include) == (expected, match), cut
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        assert run([text[:a], text[a:b], text[b:]], stop, include) == (expected, match), (a, b)


@pytest.mark.parametrize("text, stop, include, expected, match", CASES)
def test_character_by_character_never_leaks_the_stop_string(text, stop, include, expected, match):
    matcher = StopMatcher(stop, include)
    emitted = ""
    for char in text:
        emitted += matcher.feed(char)
        if not include:
            assert not any(s in emitted for s in stop)
    emitted += matcher.flush()
    assert emitted == expected


def test_held_text_is_released_as_soon_as_it_cannot_start_a_stop_string():
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("AY") == "STAY"


def test_no_stop_strings_passes_through():
    matcher = StopMatcher(())
    assert matcher.feed("anything") == "anything"
    assert matcher.flush() == ""
