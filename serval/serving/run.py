"""Running GenerationRequests on the event loop: the one place the server and the offline LLM hand planned
requests to the engine and read their outputs back.

Owns admitting every engine request of the requests together (all or none: a refusal is raised as one
ServingError before anything runs), reading their outputs from one asyncio queue, folding each into its
GenerationRequest (aborting an engine request a stop string ended early), the request deadline and a
shutdown's grace period (serving/drain.py), and aborting whatever still runs when the reader goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from serval.engine.messages import RequestFailed
from serval.serving.drain import CUT_OFF, Drain
from serval.serving.errors import from_engine, from_failure
from serval.serving.generation import GenerationRequest
from serval.serving.stream import Event


async def run_requests(
    engine,
    drain: Drain,
    requests: list[GenerationRequest],
    timeout: float | None = None,
    observe: Callable[[Event], None] | None = None,
) -> AsyncIterator[tuple[int, Event]]:
    """(index into `requests`, event): every request's ChoiceDeltas as they come (interleaved), then each one's
    Usage in order; each event is passed to `observe` first (the API's metrics). Closing the iterator aborts
    every engine request still running. engine: an EngineClient (or cluster/'s client of the replicas)."""
    # One queue for every engine request (the engine thread fills it); a refusal on the engine thread arrives
    # on it as a RequestFailed, raised once here as a ServingError.
    queue: asyncio.Queue = asyncio.Queue()
    drain.register(queue)  # ShuttingDownError once the grace period is over
    try:
        streams = engine.add_requests([new for r in requests for new in r.new_requests], queue)
    except Exception as e:  # translated once, for the HTTP layer
        drain.unregister(queue)
        raise from_engine(e) from e
    stream_of = {stream.request_id: stream for stream in streams}
    owner = {new.request_id: i for i, request in enumerate(requests) for new in request.new_requests}
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    try:
        while not all(request.is_finished for request in requests):
            try:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                event = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                event = CUT_OFF
            if event is CUT_OFF:
                deltas = [(i, delta) for i, request in enumerate(requests) for delta in request.cut_off()]
            else:
                deltas = _feed(requests, owner[event.request_id], stream_of[event.request_id], event)
            for i, delta in deltas:
                if observe is not None:
                    observe(delta)
                yield i, delta
        for i, request in enumerate(requests):
            usage = request.usage()
            if observe is not None:
                observe(usage)
            yield i, usage
    finally:
        # NOTE: no awaiting here: under a cancelled scope (a client that went away) every await would be
        # cancelled again. Closing a stream aborts its engine request unless it finished.
        drain.unregister(queue)
        for stream in streams:
            stream.close()


def _feed(requests: list[GenerationRequest], i: int, stream, event) -> list[tuple[int, Event]]:
    """One engine event folded into request i: its deltas (a RequestFailed is raised as a ServingError)."""
    stream.note(event)
    if isinstance(event, RequestFailed):
        raise from_failure(event)
    deltas, is_cut_short = requests[i].feed(event)
    if is_cut_short:
        stream.close()  # a stop string matched: abort the engine request
    return [(i, delta) for delta in deltas]
