"""Drain: the serving side of a graceful shutdown, for one Frontend.

Owns what "shutting down" means to the generations: once `begin(grace_seconds)` is called the server takes no
new work (the HTTP layer refuses new requests), the generations in flight go on for the grace period, and then
each one still running is cut off: its choices end with what they have (finish_reason "length", as at the
request timeout) and its usage, so a stream ends with a proper last chunk rather than a dropped connection.
A generation that would start after that moment is refused (ShuttingDownError).

Each generation registers the asyncio.Queue it reads its engine outputs from; cutting off puts CUT_OFF on every
registered queue, so the reader wakes at once and nothing is polled meanwhile.
"""

from __future__ import annotations

import asyncio
import logging

from serval.serving.errors import ShuttingDownError

logger = logging.getLogger(__name__)

# Put on a generation's queue (whose entries are otherwise the engine's events for it): end it now.
CUT_OFF = (-1, "cut off")


class Drain:
    def __init__(self) -> None:
        self.is_draining = False  # set by begin(): no new requests
        self.is_cut_off = False  # set when the grace period ran out: no new generations either
        self._queues: set[asyncio.Queue] = set()  # the queues of the generations in flight

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def begin(self, grace_seconds: float) -> None:
        """Start draining (on the event loop); the generations in flight are cut off after grace_seconds."""
        if self.is_draining:
            return
        self.is_draining = True
        logger.info(
            "shutting down: %d generation(s) in flight may run %.1f s more", self.num_in_flight, grace_seconds
        )
        asyncio.get_running_loop().call_later(grace_seconds, self.cut_off)

    def cut_off(self) -> None:
        """End every generation in flight now, and refuse any later one."""
        self.is_draining = True
        self.is_cut_off = True
        if self._queues:
            logger.info("grace period over: cutting off %d generation(s)", len(self._queues))
        for queue in self._queues:
            queue.put_nowait(CUT_OFF)

    def register(self, queue: asyncio.Queue) -> None:
        """A generation starts reading `queue`; ShuttingDownError once the grace period is over."""
        if self.is_cut_off:
            raise ShuttingDownError("the server is shutting down")
        self._queues.add(queue)

    def unregister(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)
