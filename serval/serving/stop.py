"""StopMatcher: finds stop strings in a stream of text pieces, whatever the split.

Owns the one rule the stream must keep: text that could still turn out to be the start of a stop string is held
back, so a stop string never leaks into the output (in a stream or not), and text that cannot be is released at
once. The pieces come from the detokenizer, so matches across token boundaries are found like any other.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop: tuple[str, ...], include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""  # a tail of the text that is a proper prefix of some stop string
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, text: str) -> str:
        """Take the next piece; return the text now safe to emit. After a match, `matched` is set and all
        further text is dropped."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        buffer = self.held + text
        match_index, match = self._find_first(buffer)
        if match is not None:
            self.matched = match
            self.held = ""
            end = match_index + len(match) if self.include_stop_str_in_output else match_index
            return buffer[:end]
        num_held = self._num_partial_suffix(buffer)
        self.held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held]

    def flush(self) -> str:
        """The generation ended without a match: release the held tail."""
        held, self.held = self.held, ""
        return held if self.matched is None else ""

    def _find_first(self, buffer: str) -> tuple[int, str | None]:
        # The match that completes first wins (that is when generation would have seen it, however the text
        # was split); among those ending together, the longest. Found with str.find, the first occurrence of
        # each string is its earliest-ending one.
        best_end, best_index, best = len(buffer) + 1, len(buffer), None
        for s in self.stop:
            index = buffer.find(s)
            if index == -1:
                continue
            end = index + len(s)
            if end < best_end or (end == best_end and index < best_index):
                best_end, best_index, best = end, index, s
        return best_index, best

    def _num_partial_suffix(self, buffer: str) -> int:
        # The longest tail of the buffer that some stop string starts with (shorter than that string: a whole
        # one would have matched). Scanning start positions left to right finds the longest first.
        longest = 0
        for s in self.stop:
            for start in range(max(0, len(buffer) - len(s) + 1), len(buffer) - longest):
                if s.startswith(buffer[start:]):
                    longest = len(buffer) - start
                    break
        return longest
