"""ReplicaClient: the ingress's stand-in for EngineClient when the engines are Ray Serve replicas.

Frontend and the API use it exactly as they use EngineClient (add_requests with one shared queue, streams
that abort on close, stats, loras, load_lora / unload_lora), so every endpoint, parameter, stream and error
behaves as on one server. Per add_requests call it makes one streaming call to the deployment: the router
(router.py) picks the replica, which streams the engine's events back; a pump task puts them on the
streams' queues exactly as EngineClient's engine thread does.

Faults: a replica that dies mid-call fails the requests it held with EngineDeadError ("the replica serving
this request died", a 500 engine_error), except a call that had received nothing yet, which is sent again
once (to a live replica; Ray Serve restarts the dead one). Closing every unfinished stream of a call cancels
it, which aborts its requests on the replica (replica.py).

Counters: a thread polls one replica's ReplicaReport every report_period_s (the router sends polls round
robin); stats() sums the fresh ones, health() lists them. A replica not heard from for report_stale_after_s
counts as down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass

from serval.cluster.config import ReplicaConfig
from serval.cluster.wire import LoraSource, ReplicaBatch, ReplicaInfo, ReplicaReport, block_hashes
from serval.engine.admission import check_admissible
from serval.engine.lora import LoraCard, UnknownLoraError, check_can_add
from serval.engine.messages import EngineDeadError, EngineStats, FailureKind, NewRequest, RequestFailed
from serval.engine.outputs import RequestOutput
from serval.engine.request_stream import Event, RequestStream

logger = logging.getLogger(__name__)

REPLICA_DIED = "the replica serving this request died"
MAX_ROUTED_BLOCKS = 64  # the router matches prompt heads up to this many blocks (1,024 tokens by default)


@dataclass
class _Call:
    """One add_requests call's streaming call to a replica."""

    streams: dict[str, RequestStream]
    open_ids: set[str]  # neither finished nor closed by their reader
    task: asyncio.Task | None = None
    num_attempts: int = 0
    received: bool = False  # an event came back: a failure now can't be retried


class ReplicaClient:
    def __init__(self, handle, info: ReplicaInfo, config: ReplicaConfig) -> None:
        self._handle = handle
        self._config = config
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.runner_info = info.runner_info
        self._max_queue_len = info.max_queue_len
        self._block_size = info.runner_info.block_size
        self._start_lora_names = set(info.loras)
        # Adapters as /v1/models shows them; run-time ones also by where to load them from (replicas that lack
        # one load it before a request using it: wire.LoraSource).
        self.loras: dict[str, LoraCard] = dict(info.loras)
        self._lora_sources: dict[str, LoraSource] = {}
        self._calls: dict[str, _Call] = {}  # by request id (every id of a call maps to the same _Call)
        self._stopped = False
        self._reports: dict[str, tuple[ReplicaReport, float]] = {}  # replica id -> latest, when received
        self._reports_lock = threading.Lock()
        self._stop_polling = threading.Event()
        self._poller = threading.Thread(target=self._poll_reports, name="serval-replica-reports", daemon=True)
        self._poller.start()

    # ---- requests (the event loop)

    def add_requests(
        self, requests: list[NewRequest], shared_queue: asyncio.Queue | None = None
    ) -> list[RequestStream]:
        """As EngineClient.add_requests: the same checks raise here, before anything is sent; a refusal on the
        replica (its waiting queue full) arrives as a RequestFailed on the streams."""
        if self._stopped:
            raise EngineDeadError("the engine has stopped")
        ids = check_admissible(requests, self.max_model_len, self.loras, self._max_queue_len)
        in_use = [request_id for request_id in ids if request_id in self._calls]
        if in_use:
            raise ValueError(f"request id {in_use[0]!r} is already in use")
        streams = [RequestStream(self, request_id, shared_queue) for request_id in ids]
        call = _Call({s.request_id: s for s in streams}, set(ids))
        for request_id in ids:
            self._calls[request_id] = call
        call.task = asyncio.get_running_loop().create_task(self._pump(call, self._batch(requests)))
        return streams

    async def generate(self, request_id, prompt_token_ids, params, eos_token_ids=(), constraint=None,
                       num_pinned_prompt_tokens=0, lora_name=None):  # fmt: skip
        """As EngineClient.generate: the deltas of one request; closing the iterator early aborts it."""
        request = NewRequest(
            request_id, list(prompt_token_ids), params, tuple(eos_token_ids), constraint,
            num_pinned_prompt_tokens, lora_name=lora_name,
        )  # fmt: skip
        (stream,) = self.add_requests([request])
        async for output in stream:
            yield output

    def abort(self, request_id: str) -> None:
        """A reader closed an unfinished stream: once no stream of its call is open, cancel the call (the
        replica then aborts what still runs). NOTE: while siblings run (n > 1, one ended by a stop string),
        the replica keeps generating the closed one until the call ends: there is no per-request channel back
        to the replica, and the extra tokens are dropped here."""
        call = self._calls.pop(request_id, None)
        if call is None:
            return
        call.open_ids.discard(request_id)
        if not call.open_ids and call.task is not None and not call.task.done():
            call.task.cancel()

    def forget_stream(self, request_id: str) -> None:
        # RequestStream.close: its events have no reader any more. An unfinished one is aborted right after
        # (abort needs its call then); a finished one is done with.
        call = self._calls.get(request_id)
        if call is None:
            return
        call.streams.pop(request_id, None)
        if request_id not in call.open_ids:
            del self._calls[request_id]

    def _batch(self, requests: list[NewRequest]) -> ReplicaBatch:
        lora = requests[0].lora_name
        loras = tuple(self._lora_sources[r.lora_name] for r in requests if r.lora_name in self._lora_sources)
        hashes = block_hashes(requests[0].prompt_token_ids, self._block_size, MAX_ROUTED_BLOCKS, lora)
        return ReplicaBatch(tuple(requests), tuple(set(loras)), frozenset(self._lora_sources), hashes)

    async def _pump(self, call: _Call, batch: ReplicaBatch) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        while True:
            call.num_attempts += 1
            response = self._handle.options(stream=True).generate.remote(batch)
            try:
                async for events in response:
                    call.received = True
                    self._deliver(call, events)
                return
            except asyncio.CancelledError:
                response.cancel()  # every reader went away: the replica aborts the requests
                raise
            except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                if not call.received and call.num_attempts < 2:
                    logger.warning("a replica died before answering; sending the request again: %s", e)
                    continue
                logger.warning("a replica died with %d requests in flight", len(call.open_ids))
                self._fail(call, REPLICA_DIED)
                return
            except Exception as e:
                logger.exception("a replica call failed")
                self._fail(call, f"generation failed on a replica: {type(e).__name__}")
                return

    def _deliver(self, call: _Call, events: list[Event]) -> None:
        for event in events:
            stream = call.streams.get(event.request_id)
            if isinstance(event, RequestFailed) or (isinstance(event, RequestOutput) and event.finished):
                call.open_ids.discard(event.request_id)
                if stream is None:  # its reader went away: nothing more will come for it
                    self._calls.pop(event.request_id, None)
            if stream is not None:  # else its reader went away
                stream.queue.put_nowait(event)

    def _fail(self, call: _Call, message: str) -> None:
        failed = [RequestFailed(i, message, FailureKind.ENGINE_DEAD) for i in list(call.open_ids)]
        self._deliver(call, failed)

    # ---- adapters

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoraCard:
        """Load on one replica, which checks the adapter (a LoraError comes back as on one server); the others
        load it before their first request that uses it."""
        check_can_add(self.loras, self.runner_info.max_loras, name)
        from ray.exceptions import RayTaskError

        try:
            card = await self._handle.load_lora.remote(name, path, base_model_name)
        except RayTaskError as e:  # the replica's LoraError itself, without Ray's traceback in its message
            raise e.cause if isinstance(e.cause, Exception) else e
        self.loras = {**self.loras, name: card}
        self._lora_sources = {**self._lora_sources, name: LoraSource(name, path, base_model_name)}
        return card

    async def unload_lora(self, name: str) -> LoraCard:
        """Forget the adapter here at once (new requests for it get a 404); each replica unloads it at its
        next request once nothing there uses it. Adapters given at start-up can't be unloaded."""
        card = self.loras.get(name)
        if card is None:
            raise UnknownLoraError(f"the LoRA adapter {name!r} is not loaded")
        if name in self._start_lora_names:
            from serval.engine.lora import LoraConflictError

            raise LoraConflictError(f"the LoRA adapter {name!r} was loaded at start-up on every replica")
        self.loras = {k: v for k, v in self.loras.items() if k != name}
        self._lora_sources = {k: v for k, v in self._lora_sources.items() if k != name}
        return card

    # ---- counters, health

    def reports(self) -> list[ReplicaReport]:
        """The replicas heard from recently, by id."""
        now = time.monotonic()
        with self._reports_lock:
            fresh = [r for r, at in self._reports.values() if now - at < self._config.report_stale_after_s]
        return sorted(fresh, key=lambda r: r.replica_id)

    def stats(self) -> EngineStats:
        """Every live replica's counters summed (a counter of a replica Ray restarted starts again at 0)."""
        reports = self.reports()
        if not reports:  # none heard from yet (or all down): nothing runs, no KV block in use
            return EngineStats(0, 0, 1, 1, 0, 0, 0, 0, 0)
        sums = {
            f.name: _sum([getattr(r.stats, f.name) for r in reports]) for f in dataclasses.fields(EngineStats)
        }
        return EngineStats(**sums)

    def health(self) -> dict:
        reports = self.reports()
        status = (
            "ok" if len(reports) == self._config.num_replicas else "degraded" if reports else "unavailable"
        )
        replicas = [
            {"id": r.replica_id, "pid": r.pid, "node_id": r.node_id, "num_threads": r.num_threads,
             "num_running": r.stats.num_running,
             "num_waiting": r.stats.num_waiting, "num_prefix_cache_hits": r.stats.num_prefix_cache_hits,
             "num_prefix_cache_queries": r.stats.num_prefix_cache_queries}
            for r in reports
        ]  # fmt: skip
        return {"status": status, "num_replicas": self._config.num_replicas, "replicas": replicas}

    def _poll_reports(self) -> None:
        while not self._stop_polling.wait(self._config.report_period_s):
            try:
                # A replica of one busy thread can take seconds to answer on an oversubscribed machine.
                report = self._handle.report.remote().result(timeout_s=5.0)
            except Exception as e:  # noqa: BLE001 - a replica restarting, or none up yet: the next poll goes on
                logger.debug("no replica report: %s", e)
                continue
            with self._reports_lock:
                self._reports[report.replica_id] = (report, time.monotonic())

    def shutdown(self) -> None:
        self._stopped = True
        self._stop_polling.set()
        self._poller.join(timeout=5)


def _sum(values: list) -> int | float | tuple:
    """A counter summed over replicas; a tuple of counters (accepted drafts by position) position by position."""
    if values and isinstance(values[0], tuple):
        return tuple(sum(column) for column in itertools.zip_longest(*values, fillvalue=0))
    return sum(values)
