"""RequestStream: what the event loop holds for one admitted engine request, whichever client admitted it.

Events (a RequestOutput per step, or the RequestFailed that ends it) arrive on an asyncio queue, its own or
one shared by the requests of one API request; closing the stream before its last event aborts the request
through the client that admitted it (EngineClient, or the replicas' ReplicaClient in serval/cluster/).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from serval.engine.messages import RequestFailed
from serval.engine.outputs import RequestOutput


class StreamOwner(Protocol):
    """The client side a stream reports to: it forgets the stream's events, and aborts its request."""

    def forget_stream(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...


Event = RequestOutput | RequestFailed


class RequestStream:
    """The events of one admitted request, read on the event loop: iterate it once for its RequestOutputs; a
    RequestFailed ends it by raising its error. Or, when several requests share one queue (add_requests'
    `shared_queue`), read that queue and pass each of this request's events to note(). close() aborts the request
    unless it finished; it never awaits (safe in a cancelled scope) and may be called again."""

    def __init__(
        self, client: StreamOwner, request_id: str, shared_queue: asyncio.Queue | None = None
    ) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        # Filled by the engine thread: this request's own, or one shared by the requests of one API request.
        self.queue: asyncio.Queue[Event] = asyncio.Queue() if shared_queue is None else shared_queue
        self.is_finished = False
        self._client = client
        self._is_closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.is_finished:
                match await self.queue.get():
                    case RequestFailed() as failed:
                        self.is_finished = True
                        raise failed.error()
                    case RequestOutput() as output:
                        self.is_finished = output.finished
                        yield output
        finally:
            self.close()

    def note(self, event: Event) -> None:
        """A reader of a shared queue saw `event` of this request: a failure or a last output ends it."""
        self.is_finished = self.is_finished or isinstance(event, RequestFailed) or event.finished

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._client.forget_stream(self.request_id)
        if not self.is_finished:
            self._client.abort(self.request_id)
