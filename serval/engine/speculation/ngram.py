"""Prompt lookup: drafts copied from the sequence itself.

A sequence that quotes, rewrites or extends text it has seen (its prompt, or what it already wrote) tends to
continue a stretch of tokens the way that stretch continued before. So: take the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min), find where they occurred last before, and propose the
tokens that followed them there. Nothing is learned and nothing is run; a sequence with no repeat gets no
drafts and decodes as usual. (vLLM's "ngram" method, llama.cpp's ngram-simple.)
"""

from __future__ import annotations

import numpy as np

from serval.engine.request import Request


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def prepare(self, candidates: list[tuple[Request, int]]) -> None:
        pass  # nothing is run ahead: each lookup is its own

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self.lookup(request.token_ids, max_drafts)

    def forget(self, request: Request) -> None:
        pass  # nothing is kept per request

    def lookup(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens that followed the latest earlier occurrence of the longest suffix
        (min_n <= n <= max_n) that occurred before; [] when none did."""
        num_tokens = len(token_ids)
        if max_drafts <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Where the last token occurred before (not as the last token itself): every match of a longer suffix
        # ends at one of these, so the suffixes are checked only there.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            candidates = ends[ends >= n - 1]
            for offset in range(1, n):  # the suffix's other tokens, walking back
                if candidates.size == 0:
                    break
                candidates = candidates[tokens[candidates - offset] == tokens[-1 - offset]]
            if candidates.size:
                start = int(candidates[-1]) + 1  # the latest occurrence's continuation
                return token_ids[start : start + max_drafts]
        return []
