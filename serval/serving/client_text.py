"""Client text inside a chat template: which client strings are cut out of the template's text, the
placeholders that stand in for them while the template runs, and the split of the rendered string back into
template segments (encoded with special-token parsing) and client segments (encoded as plain text).

Owns the rule that only the template's own literals become special tokens. Every string of the request that a
template can print (message text, reasoning, names, tool-call ids, names and arguments, tool descriptions and
schemas, chat_template_kwargs values) is replaced by a placeholder `SERVAL<nonce><escapes>N<index>E`: letters
and digits only, so templates that trim or concatenate it keep it intact, and a per-render nonce, so a client
cannot forge one. `tojson` records in the placeholder that its text now sits inside a JSON string (the
escapes), so the client segment is exactly what json.dumps of the original would have written.

When the vocabulary's special-token texts are known, a client string is cut out only if it could take part
in one (SpecialTexts.could_form): every other string renders exactly as the template expects, so templates
that compare schema types, tool names or a kwargs value still work. Without them every non-empty client
string is cut out. Names templates look up or compare (dict keys, `type` values) are kept either way when they
are plain identifiers holding no whole special token, and a plain-identifier `role` always is: Phi-3 builds
`<|user|>` from it.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# A placeholder with any nonce: `tojson` (which cannot know the render's nonce) adds its escape letter to it.
_ANY_PLACEHOLDER = re.compile(r"(SERVAL[0-9a-f]{16})([JA]*)(N\d+E)")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
# Where a template message's media parts sit in its text, in characters (api/requests.py sets it); never
# shown to the template.
MEDIA_OFFSETS_KEY = "serval_media_offsets"


@dataclass(frozen=True)
class CacheSpan:
    """A stretch of one message's text marked `cache_control` (explicit prompt caching): the prompt up to the
    end of the last such stretch is pinned. Carried beside the messages, never inside their text."""

    message_index: int
    start: int  # characters into the message's text (its "content")
    end: int
    option: str = "ephemeral"

    def shifted(self, message_index: int, num_chars: int) -> CacheSpan:
        """The same stretch after a rewrite moved its message and put num_chars of text before it."""
        return CacheSpan(message_index, self.start + num_chars, self.end + num_chars, self.option)


@dataclass(frozen=True)
class Segment:
    text: str
    is_client_text: bool  # True: encode as plain text, never as special tokens
    ends_cache_prefix: bool = False  # the explicit-cache prefix (cache_control) ends with this segment
    # The next this-many media items of the request go here, before `text` (which is then ""): where the
    # message's content list puts them among its text parts (serving/media/processor.py).
    num_media: int = 0


def escape_placeholders(json_text: str, ensure_ascii: bool) -> str:
    """`tojson`'s output with each placeholder marked as now sitting inside a JSON string literal."""
    letter = "A" if ensure_ascii else "J"
    return _ANY_PLACEHOLDER.sub(lambda m: f"{m[1]}{m[2]}{letter}{m[3]}", json_text)


class SpecialTexts:
    """The vocabulary's special-token texts, and whether a client string could take part in one.

    A string that is printed as is, next to any template text or other strings, can share characters with a
    special token only if the token lies inside it, it lies inside the token, or the two overlap at one end
    (a suffix of the token starts the string, or a prefix of the token ends it). Compared case-insensitively,
    and also in the string's JSON-escaped form (what `tojson` prints), so templates that lower-case or
    serialize the string are covered too.
    """

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = tuple(sorted({t.lower() for t in texts if t}))
        self.prefixes = frozenset(t[:k] for t in self.texts for k in range(1, len(t)))
        self.suffixes = frozenset(t[k:] for t in self.texts for k in range(1, len(t)))
        self.max_len = max((len(t) for t in self.texts), default=0)
        self.inside = re.compile("|".join(map(re.escape, self.texts))) if self.texts else None

    def contains(self, text: str) -> bool:
        """Whether a special token lies inside `text`."""
        return self.inside is not None and self.inside.search(text.lower()) is not None

    def could_form(self, text: str) -> bool:
        """Whether `text` could share characters with a special token, wherever it is printed."""
        lowered = text.lower()
        return self._overlaps(lowered) or self._overlaps(json.dumps(lowered, ensure_ascii=False)[1:-1])

    def _overlaps(self, text: str) -> bool:
        if self.inside is None or not text:
            return False
        if self.inside.search(text):
            return True
        if len(text) < self.max_len and any(text in t for t in self.texts):
            return True
        ends = range(1, min(len(text), self.max_len) + 1)
        return any(text[:k] in self.suffixes or text[-k:] in self.prefixes for k in ends)


class ClientTexts:
    """One render's client strings: `mask_*` swaps them for placeholders, `split` swaps them back."""

    def __init__(self, special: SpecialTexts | None) -> None:
        self.special = special
        self.nonce = secrets.token_hex(8)
        self.pattern = re.compile(f"SERVAL{self.nonce}([JA]*)N(\\d+)E")
        self.texts: list[str] = []
        # (index of a masked text, characters into it) where the explicit-cache prefix ends, or None.
        self.cache_cut: tuple[int, int] | None = None
        # index of a masked content -> where its message's media sit in it (characters, in order)
        self.media_at: dict[int, tuple[int, ...]] = {}

    def placeholder(self, text: str) -> str:
        self.texts.append(text)
        return f"SERVAL{self.nonce}N{len(self.texts) - 1}E"

    def text(self, value: str, is_name: bool = False) -> str:
        """`value`, or a placeholder for it. is_name: a dict key or a `type`, which templates look up or
        compare, so a plain identifier is kept unless it holds a whole special token: it could join one only
        through the template's own literals around it (that is the template's doing, as Phi-3's role is)."""
        # NOTE: an empty string is left as is: it holds nothing to protect, and `{% if name %}` must stay false.
        if not value:
            return value
        if is_name and _IDENTIFIER.fullmatch(value):
            is_kept = self.special is None or not self.special.contains(value)
        else:
            is_kept = self.special is not None and not self.special.could_form(value)
        return value if is_kept else self.placeholder(value)

    def value(self, value: Any) -> Any:
        """`value` with every string in it (dict keys too: a schema's property names) checked by `text`."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, (list, tuple)):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {
                (self.text(k, True) if isinstance(k, str) else k): self._field(k, v) for k, v in value.items()
            }
        return value

    def _field(self, key: Any, value: Any) -> Any:
        if isinstance(value, str) and key in ("role", "type"):
            # NOTE: a plain-identifier role is kept even where it spells part of a special token: Phi-3 builds
            # `<|user|>` from it, and the API layer checks roles against the template's.
            if key == "role" and _IDENTIFIER.fullmatch(value):
                return value
            return self.text(value, is_name=True)
        return self.value(value)

    def mask_message(self, message: dict[str, Any], cache_end: int | None = None) -> dict[str, Any]:
        """cache_end: characters into this message's content where the explicit-cache prefix ends."""
        # NOTE: content is always a placeholder, even when harmless: the frontend finds the turns (the cache
        # prefix's end, where the answer starts, the final message to continue) by its client segments.
        shown = [key for key in message if key != MEDIA_OFFSETS_KEY]
        masked = {key: self._field(key, message[key]) for key in shown if key != "content"}
        content = message.get("content")
        media_offsets = tuple(message.get(MEDIA_OFFSETS_KEY, ()))
        if isinstance(content, str) and (content or media_offsets):
            masked["content"] = self.placeholder(content)
            if cache_end is not None:
                self.cache_cut = (len(self.texts) - 1, cache_end)
            if media_offsets:
                self.media_at[len(self.texts) - 1] = media_offsets
        else:
            masked["content"] = content
        return {key: masked[key] for key in shown}

    def split(self, rendered: str) -> list[Segment]:
        """The rendered string as template and client segments, each placeholder replaced by its text (escaped
        as the template's `tojson` calls escaped it); the text the cache prefix ends in is split in two."""
        segments: list[Segment] = []
        position = 0
        for match in self.pattern.finditer(rendered):
            if match.start() > position:
                segments.append(self._template_segment(rendered[position : match.start()]))
            index = int(match.group(2))
            segments.extend(self._client_segments(index, match.group(1)))
            position = match.end()
        if position < len(rendered):
            segments.append(self._template_segment(rendered[position:]))
        return segments

    def _client_segments(self, index: int, escapes: str) -> list[Segment]:
        """One client text's segments: its pieces between the places its message's media sit (a media
        segment each) and where the explicit-cache prefix ends (the piece before it flagged)."""
        text = self.texts[index]
        offsets = self.media_at.get(index, ())
        # (position, order, number of media items): media first where the prefix also ends there (NOTE: a
        # cache_control on a media part ends the prefix after that part, so media there count as inside it).
        stops = [(offset, 0, offsets.count(offset)) for offset in sorted(set(offsets))]
        if self.cache_cut is not None and self.cache_cut[0] == index:
            stops.append((self.cache_cut[1], 1, 0))
        segments, start = [], 0
        # NOTE: the pieces are encoded apart, so the prefix's tokens do not depend on what follows it (a later
        # request with the same prefix and another continuation finds the same blocks).
        for position, is_cut, num_media in sorted(stops):
            piece = self._escaped(text[start:position], escapes)
            if is_cut:
                segments.append(Segment(piece, is_client_text=True, ends_cache_prefix=True))
            else:
                if piece:
                    segments.append(Segment(piece, is_client_text=True))
                segments.append(Segment("", is_client_text=False, num_media=num_media))
            start = position
        tail = self._escaped(text[start:], escapes)
        if tail:
            segments.append(Segment(tail, is_client_text=True))
        return segments

    @staticmethod
    def _escaped(text: str, escapes: str) -> str:
        for letter in escapes:  # escaping is per character, so the pieces escape apart
            text = json.dumps(text, ensure_ascii=letter == "A")[1:-1]
        return text

    def _template_segment(self, text: str) -> Segment:
        if self.nonce in text.lower():
            # The template cut or changed a placeholder (slicing, upper-casing): its client text can no longer
            # be kept apart, and the prompt would hold the placeholder instead, so refuse rather than guess.
            raise ValueError(
                "the chat template altered a message's text in a way serval cannot render safely"
            )
        return Segment(text, is_client_text=False)

    def is_placeholder(self, value: Any) -> bool:
        return isinstance(value, str) and self.pattern.fullmatch(value) is not None

    def end_of(self, rendered: str, placeholder: str) -> int | None:
        """Where the last copy of `placeholder` (escaped or not) ends in the rendered string, or None."""
        index = self.pattern.fullmatch(placeholder).group(2)
        ends = [m.end() for m in self.pattern.finditer(rendered) if m.group(2) == index]
        return ends[-1] if ends else None
