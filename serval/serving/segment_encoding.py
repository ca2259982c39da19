"""A rendered chat prompt's segments -> its token ids (serving/client_text.py makes the segments).

Text the client wrote is encoded plainly, so a special token's spelling in it stays text; the template's own
text is encoded with its special tokens. Also found on the way: how many leading ids the explicit-cache
prefix covers, and where each media item's run of placeholder ids goes (the spot its part sat in).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serval.serving.client_text import Segment
from serval.serving.errors import InvalidRequestError
from serval.serving.media.processor import MediaItem, MediaProcessor, MediaSpan, place_media

if TYPE_CHECKING:
    from serval.serving.tokenizer import Tokenizer


def encode_segments(
    segments: list[Segment],
    tokenizer: Tokenizer,
    media: list[MediaItem],
    media_processor: MediaProcessor | None,
) -> tuple[list[int], int, tuple[MediaSpan, ...]]:
    """The prompt ids, how many of them the explicit-cache prefix covers (0 without one), and the media
    items' runs placed where the template put their messages (serving/media/processor.py)."""
    token_ids: list[int] = []
    num_prefix_tokens = 0
    slots: list[int] = []  # positions in token_ids before which the next media item's run goes
    for segment in segments:
        slots.extend([len(token_ids)] * segment.num_media)
        if segment.is_client_text:
            token_ids.extend(tokenizer.encode_plain(segment.text))
        else:
            token_ids.extend(tokenizer.encode(segment.text))
        if segment.ends_cache_prefix:
            num_prefix_tokens = len(token_ids)
    if not slots and not media:
        return token_ids, num_prefix_tokens, ()
    assert media_processor is not None, "check_media refuses media without a processor"
    try:
        return place_media(token_ids, slots, media, media_processor, num_prefix_tokens)
    except ValueError as e:
        raise InvalidRequestError(str(e), "messages") from e


def answer_start(segments: list[Segment], continue_final_message: bool) -> str:
    """The prompt text where the answer begins: after the last client text (from it, when continuing it)."""
    client = [i for i, segment in enumerate(segments) if segment.is_client_text]
    start = (client[-1] if continue_final_message else client[-1] + 1) if client else 0
    return "".join(segment.text for segment in segments[start:])
