"""ResponseStore: the Responses API's `store` and `previous_response_id`, bounded, in memory, off by default.

Owns what is kept and for how long: per stored response its response object (GET /v1/responses/{id}) and the
conversation it ended (its input as chat messages without the instructions, then its answer), which a later
request naming it as previous_response_id continues. At most `max_entries` are held (the oldest dropped
first) and none past `max_age` seconds of the injected clock. One per app (built by the route module); a
restart forgets everything, which docs/api.md says.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # chat messages: the input (no instructions), then the answer
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_age = max_age
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def is_enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._expire()
        self._entries[response["id"]] = StoredResponse(response, conversation, self.clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        # Insertion order is age order: expired entries are all at the front.
        deadline = self.clock() - self.max_age
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > deadline:
                return
            self._entries.popitem(last=False)
