"""IncrementalDetokenizer: token ids in, text deltas out, equal in sum to decoding all the ids at once.

Owns the boundary problem: one character can span several tokens (byte-level BPE splits UTF-8), and some
decoders change a token's text depending on its neighbours. Each step decodes a small window twice, with and
without the new tokens, and emits the difference; an incomplete character at the end (decoded as U+FFFD) is
held back until its last byte arrives, so a stream never carries half a character. `flush` releases what is left when
the generation ends, even if it is an invalid byte sequence.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    special_token_ids: frozenset[int]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        kept_special_ids: frozenset[int] = frozenset(),
    ) -> None:
        """kept_special_ids: special tokens decoded as text even when the others are skipped (the markers a
        tool-call or reasoning parser reads: Kimi-K2's <|tool_call_begin|>, ...)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.kept_special_ids = kept_special_ids if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        # token_ids[prefix_offset:read_offset] is already-emitted context for the decoder; tokens from
        # read_offset on are not emitted yet. Both move only at character boundaries.
        self.prefix_offset = 0
        self.read_offset = 0
        # Characters after the window's already-emitted text that went out while it still ended in an
        # incomplete character.
        self.num_emitted_ahead = 0

    def feed(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        start = len(prefix_text) + self.num_emitted_ahead
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            # An incomplete character at the end: release what comes before it, hold it until its last byte.
            complete = full_text.rstrip(REPLACEMENT_CHAR)
            delta = complete[start:]
            self.num_emitted_ahead += len(delta)
            return delta
        if len(full_text) <= len(prefix_text) and not final:
            return ""  # only skipped (special) tokens so far; keep them in the window
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.num_emitted_ahead = 0
        return full_text[start:]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        if self.kept_special_ids:
            special = self.tokenizer.special_token_ids
            kept = [i for i in token_ids if i in self.kept_special_ids or i not in special]
            return self.tokenizer.decode(kept, skip_special_tokens=False)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
