"""EngineReplica: the class Ray Serve runs once per replica; it owns an Engine through an EngineClient.

The ingress calls `generate` with streaming on: the replica admits the batch (EngineClient.add_requests, all
or none) and yields every engine event as it comes, a list at a time. When the ingress cancels the call (its
HTTP client went away, or every choice ended), Ray cancels this generator; its `finally` closes the streams,
which aborts the requests still running and frees their KV blocks at the engine's next step.

The thread count is set before the model loads, in this process: torch's intra-op pool and OpenMP are sized
from it (Ray also sets OMP_NUM_THREADS from the actor's CPUs), so a replica of 1 thread really runs 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from serval.cluster.wire import ReplicaBatch, ReplicaInfo, ReplicaReport
from serval.config import EngineConfig
from serval.engine.client import EngineClient
from serval.engine.lora import LoraConflictError, LoraError, UnknownLoraError
from serval.engine.messages import EngineDeadError, FailureKind, QueueFullError, RequestFailed
from serval.engine.request_stream import Event

logger = logging.getLogger(__name__)


class EngineReplica:
    def __init__(self, config: EngineConfig, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.client = EngineClient.start(config)
        self.start_lora_names = tuple(self.client.loras)
        self._lora_lock = asyncio.Lock()  # one run-time adapter load or unload at a time

    def info(self) -> ReplicaInfo:
        client = self.client
        return ReplicaInfo(
            client.max_model_len, client.vocab_size, client.runner_info, client._max_queue_len,
            dict(self.client.loras),
        )  # fmt: skip

    def report(self) -> ReplicaReport:
        import torch
        from ray import get_runtime_context, serve

        replica_id = serve.get_replica_context().replica_id.unique_id
        node_id = get_runtime_context().get_node_id()
        return ReplicaReport(replica_id, os.getpid(), node_id, self.client.stats(), torch.get_num_threads())

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose engine thread has gone is restarted."""
        if not self.client._thread.is_alive():
            raise RuntimeError("the engine thread has stopped")

    async def generate(self, batch: ReplicaBatch) -> AsyncIterator[list[Event]]:
        try:
            await self._sync_loras(batch)
            queue: asyncio.Queue = asyncio.Queue()
            streams = self.client.add_requests(list(batch.requests), queue)
        except Exception as e:  # noqa: BLE001 - a refusal travels as the engine's own failure events
            yield [RequestFailed(r.request_id, str(e), _failure_kind(e)) for r in batch.requests]
            return
        stream_of = {stream.request_id: stream for stream in streams}
        try:
            while not all(stream.is_finished for stream in streams):
                events = [await queue.get()]
                while not queue.empty():  # one message per engine step, not per sequence
                    events.append(queue.get_nowait())
                for event in events:
                    stream_of[event.request_id].note(event)
                yield events
        finally:
            for stream in streams:
                stream.close()  # aborts the unfinished ones (a cancelled call)

    async def load_lora(self, name: str, path: str, base_model_name: str | None):
        async with self._lora_lock:
            return await self.client.load_lora(name, path, base_model_name)

    async def _sync_loras(self, batch: ReplicaBatch) -> None:
        """Load the run-time adapters the batch uses that this replica lacks; drop idle ones the ingress no
        longer serves (an unload reaches the replicas this way, lazily)."""
        loaded = self.client.loras
        missing = [lora for lora in batch.loras if lora.name not in loaded]
        stale = [n for n in loaded if n not in batch.lora_names and n not in self.start_lora_names]
        if not missing and not stale:
            return
        async with self._lora_lock:
            for name in stale:
                try:
                    await self.client.unload_lora(name)
                except (LoraConflictError, UnknownLoraError):
                    pass  # still in use here (or gone already): dropped at a later batch
            for lora in missing:
                if lora.name not in self.client.loras:
                    await self.client.load_lora(lora.name, lora.path, lora.base_model_name)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()


def _failure_kind(error: Exception) -> FailureKind:
    if isinstance(error, QueueFullError):
        return FailureKind.QUEUE_FULL
    if isinstance(error, UnknownLoraError):
        return FailureKind.UNKNOWN_LORA
    if isinstance(error, EngineDeadError):
        return FailureKind.ENGINE_DEAD
    if isinstance(error, LoraError | ValueError):
        return FailureKind.INVALID
    logger.exception("replica refused a batch", exc_info=error)
    return FailureKind.ENGINE_DEAD
