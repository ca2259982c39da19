"""The seam's pure parts: placing runs into a prompt, content hashes, preprocessor_config.json bounds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serval.serving.media.decode import DecodedImage
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import MediaItem, content_hash, place_media, read_resize_bounds


class Runs:
    def placeholder_ids(self, item: MediaItem) -> list[int]:
        return [-1] * item.num_tokens


def item(num_tokens: int, value: int = 0) -> MediaItem:
    decoded = DecodedImage(np.full((28, 28, 3), value, np.uint8), "png", (28, 28))
    return MediaItem(MediaKind.IMAGE, decoded, content_hash(MediaKind.IMAGE, decoded), num_tokens, "p")


def test_runs_go_before_their_slots_and_lengthen_the_pinned_prefix():
    ids, num_prefix, spans = place_media(
        [1, 2, 3, 4], [1, 3], [item(2), item(3)], Runs(), num_prefix_tokens=2
    )
    assert ids == [1, -1, -1, 2, 3, -1, -1, -1, 4]
    assert [(s.offset, s.num_tokens) for s in spans] == [(1, 2), (5, 3)]
    assert num_prefix == 4  # the first run lies inside the first two prompt tokens, the second after them
    with pytest.raises(ValueError, match="placed 1 of the 2 media parts"):
        place_media([1, 2], [0], [item(1), item(1)], Runs())


def test_content_hash_names_the_content():
    assert item(1, 5).content_hash == item(9, 5).content_hash != item(1, 6).content_hash
    assert len(item(1).content_hash) == 16


def test_resize_bounds_from_preprocessor_config(tmp_path):
    config = {"patch_size": 14, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    bounds = read_resize_bounds(str(tmp_path))
    assert (bounds.factor, bounds.min_pixels, bounds.max_pixels) == (28, 3136, 12845056)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "merge_size": 2,
                                                                   "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))  # fmt: skip
    bounds = read_resize_bounds(str(tmp_path))
    assert (bounds.factor, bounds.min_pixels, bounds.max_pixels) == (32, 65536, 16777216)
