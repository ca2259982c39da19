"""EngineClient: the seam between an asyncio front end and the engine running on its own thread.

The engine thread owns the Engine: only it reads or changes it. The event loop sends it typed commands
(engine/messages.py) on one queue, gets each request's events back on a RequestStream of its own, and reads
the engine's counters only from the EngineStats snapshot the engine thread publishes after every step and
every batch of commands. Closing a stream before it finished (a client that went away) aborts its request,
whose blocks are freed at the next step.

Admission is all or nothing: `add_requests` takes every sequence of one API request (n, best_of, several
prompts) at once, checks them all against the prompt rules and the waiting queue's free room, and either
hands them to the engine thread as one command (added together, before any step runs one) or raises before
anything is queued. So a refused request leaves nothing running and no KV block held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from serval.config import EngineConfig
from serval.engine.admission import check_admissible
from serval.engine.constraint import TokenConstraint
from serval.engine.engine import Engine
from serval.engine.loading import build_engine
from serval.engine.lora import LoraCard, LoraError, UnknownLoraError, check_can_add
from serval.engine.messages import (
    AbortRequest,
    AddRequests,
    Command,
    Embed,
    EngineDeadError,
    EngineStats,
    FailureKind,
    Flush,
    LoadLora,
    NewRequest,
    QueueFullError,
    RequestFailed,
    Stop,
    UnloadLora,
    answer,
)
from serval.engine.outputs import RequestOutput
from serval.engine.request_stream import Event, RequestStream
from serval.runner.info import RunnerInfo
from serval.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineClient:
    def __init__(self, engine: Engine):
        # What the event loop needs of the engine is copied here, before the engine thread starts: from then
        # on only that thread touches `_engine`.
        self._engine = engine
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.runner.info.vocab_size  # the logits' width (may exceed the tokenizer's)
        # What is served and how (architecture, weight format, kernels, KV cache), fixed once loaded: the
        # layers above read the runner's facts here (start-up log, /metrics, /version), never from the runner.
        self.runner_info: RunnerInfo = dataclasses.replace(
            engine.runner.info, speculative_decoding=engine.config.speculative.describe()
        )
        self._max_queue_len = engine.config.scheduler.max_queue_len
        # Reads adapter files and the model's fixed shapes, never a slot: safe on a worker thread.
        self._read_lora = engine.runner.read_lora
        # Stops a tensor-parallel runner's workers; called once the engine thread has ended.
        self._close_runner = engine.runner.close
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # Guards _streams, _stopped, _num_pending and _stats. Held while a command is queued, so none can
        # follow Stop: the engine thread handles every command sent before it.
        self._lock = threading.Lock()
        self._stopped = False
        # Requests sent to the engine thread and not yet in a published snapshot: admission counts them as
        # waiting. Taken off together with the snapshot that counts them (_publish), never before.
        self._num_pending = 0
        self._num_absorbed = 0  # engine thread only: requests taken since the last snapshot
        self._stats = _snapshot(engine)
        # The loaded adapters, for the event loop to read without a lock: the engine thread replaces the
        # dict whole after each load or unload (copy on write), never changes it in place.
        self.loras: dict[str, LoraCard] = dict(engine.loras.cards)
        self._thread = threading.Thread(target=self._run, name="serval-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig, on_runner_failure=None) -> EngineClient:
        """on_runner_failure(message): called on another thread if the runner can no longer run a step (a
        tensor-parallel worker died); the server stops itself with it."""
        engine = build_engine(config)
        if on_runner_failure is not None:
            engine.runner.watch(on_runner_failure)
        return cls(engine)

    # ---- event-loop side

    def add_requests(
        self, requests: list[NewRequest], shared_queue: asyncio.Queue | None = None
    ) -> list[RequestStream]:
        """Admit all of `requests` or none. Raises before anything is queued: ValueError (a prompt the
        context can't hold, a request id in use, more requests than the queue could ever hold),
        UnknownLoraError, QueueFullError (the waiting queue has no room for all of them), EngineDeadError.

        shared_queue: one queue for the events of all of them (each carries its request_id), so a reader of several
        sequences waits on one queue instead of one per sequence; None: a queue per stream."""
        if self._stopped:  # checked again under the lock, as the command is queued
            raise EngineDeadError("the engine has stopped")
        # The LoRA check is made again on the engine thread: an unload may get there first.
        max_queue_len = self._max_queue_len
        ids = check_admissible(requests, self.max_model_len, self.loras, max_queue_len)
        streams = [RequestStream(self, request_id, shared_queue) for request_id in ids]
        with self._lock:
            if self._stopped:
                raise EngineDeadError("the engine has stopped")
            # Every new request counts as waiting until the engine schedules it: the whole request must fit.
            num_waiting = self._stats.num_waiting + self._num_pending
            if num_waiting + len(requests) > max_queue_len:
                raise QueueFullError(
                    f"{num_waiting} requests are waiting and this one adds {len(requests)}; at most "
                    f"{max_queue_len} may wait"
                )
            in_use = [request_id for request_id in ids if request_id in self._streams]
            if in_use:
                raise ValueError(f"request id {in_use[0]!r} is already in use")
            self._streams.update(zip(ids, streams))
            self._num_pending += len(requests)
            self._commands.put(AddRequests(tuple(requests)))
        return streams

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        constraint: TokenConstraint | None = None,
        num_pinned_prompt_tokens: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request (add_requests of one); closing the iterator early aborts it."""
        request = NewRequest(
            request_id, list(prompt_token_ids), params, tuple(eos_token_ids), constraint,
            num_pinned_prompt_tokens, lora_name=lora_name,
        )  # fmt: skip
        (stream,) = self.add_requests([request])
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        # NOTE: sent even after Stop: the engine thread has gone, and an abort needs no answer.
        self._commands.put(AbortRequest(request_id))

    def forget_stream(self, request_id: str) -> None:
        # Its events have no reader any more (see RequestStream.close).
        with self._lock:
            self._streams.pop(request_id, None)

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoraCard:
        """Read and check the adapter off the engine thread, then copy it into a slot on it. LoraError (or
        its subclasses) for a bad adapter, a taken name, no free slot."""
        # Fail fast, before reading any file; the engine thread checks again.
        check_can_add(self.loras, self.runner_info.max_loras, name)
        try:
            adapter = await asyncio.to_thread(self._read_lora, path)
        except ValueError as e:
            raise LoraError(str(e)) from e
        reply = asyncio.get_running_loop().create_future()
        return await self._send_and_wait(LoadLora(name, adapter, base_model_name, reply))

    async def unload_lora(self, name: str) -> LoraCard:
        """UnknownLoraError if not loaded, LoraConflictError while requests use it."""
        reply = asyncio.get_running_loop().create_future()
        return await self._send_and_wait(UnloadLora(name, reply))

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """An embedding model's vectors, one per prompt (each checked against the context by the caller).
        ValueError for prompts the engine cannot take; EngineDeadError once stopped."""
        reply = asyncio.get_running_loop().create_future()
        return await self._send_and_wait(Embed(tuple(prompts), reply))

    async def flush(self) -> None:
        """Returns once the engine thread has handled every command sent before (aborts included)."""
        await self._send_and_wait(Flush(asyncio.get_running_loop().create_future()))

    async def _send_and_wait(self, command: LoadLora | UnloadLora | Embed | Flush) -> Any:
        with self._lock:
            if self._stopped:
                raise EngineDeadError("the engine has stopped")
            self._commands.put(command)
        return await command.reply

    def stats(self) -> EngineStats:
        """The latest snapshot, with the requests sent but not yet in it counted as waiting. A snapshot is
        published before the outputs of its step are delivered: a reader that saw an output sees stats at
        least as new as the step that made it."""
        with self._lock:
            return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + self._num_pending)

    def health(self) -> dict[str, str]:
        """/health's body. NOTE: "ok" even with the engine thread gone, as before: a failed step fails only
        its own requests, and the process is what a supervisor restarts."""
        return {"status": "ok"}

    def shutdown(self) -> None:
        """Stop the engine thread once it has handled every command sent before; the requests in flight end
        with EngineDeadError, so no reader waits forever."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._commands.put(Stop())
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the runner is the engine thread's until it has ended
            self._close_runner()

    # ---- engine-thread side

    def _run(self) -> None:
        engine = self._engine
        while True:
            # Block for work when idle; otherwise just take what arrived during the last step.
            events: list[Event] = []
            num_handled, is_running = self._handle_commands(
                events, block=not engine.has_unfinished_requests()
            )
            if num_handled:
                self._publish()
                self._deliver(events)
            if not is_running:
                return
            if not engine.has_unfinished_requests():
                continue
            try:
                events = list(engine.step())
            except Exception:  # a failed step must not kill the server
                logger.exception("engine step failed; aborting the requests in flight")
                events = self._fail_all("internal error while generating")
            self._publish()
            self._deliver(events)

    def _handle_commands(self, events: list[Event], block: bool) -> tuple[int, bool]:
        """Handle every command queued (waiting a while for one if `block`): how many, and False once Stop
        was handled."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0, True
        num_handled = 0
        while True:
            num_handled += 1
            if not self._handle(command, events):
                return num_handled, False
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return num_handled, True

    def _handle(self, command: Command, events: list[Event]) -> bool:
        match command:
            case AddRequests(requests):
                events += self._add(requests)
            case AbortRequest(request_id):
                output = self._engine.abort_request(request_id)
                if output is not None:
                    events.append(output)
            case LoadLora(name, adapter, base_model_name, reply):
                self._change_loras(reply, self._engine.add_lora, name, adapter, base_model_name)
            case UnloadLora(name, reply):
                self._change_loras(reply, self._engine.remove_lora, name)
            case Embed(prompts, reply):
                self._embed(list(prompts), reply)
            case Flush(reply):
                answer(reply, None, None)
            case Stop():
                events += self._fail_all("the engine has stopped")
                return False
        return True

    def _add(self, requests: tuple[NewRequest, ...]) -> list[Event]:
        """Add one add_requests call's requests together, between steps; if the engine refuses one, none."""
        self._num_absorbed += len(requests)
        with self._lock:
            # A caller that went away before the engine saw its requests closed their streams.
            wanted = [request for request in requests if request.request_id in self._streams]
        added: list[str] = []
        for request in wanted:
            try:
                self._engine.add_request(
                    request.request_id, request.prompt_token_ids, request.params, request.eos_token_ids,
                    request.constraint, request.num_pinned_prompt_tokens, request.share_prompt_with,
                    lora_name=request.lora_name, media=request.media,
                )  # fmt: skip
            except ValueError as e:  # UnknownLoraError included: unloaded since add_requests checked
                # No step has run since the first of them was added: aborting them frees nothing yet held.
                for request_id in added:
                    self._engine.abort_request(request_id)
                kind = FailureKind.UNKNOWN_LORA if isinstance(e, UnknownLoraError) else FailureKind.INVALID
                return [RequestFailed(other.request_id, str(e), kind) for other in wanted]
            added.append(request.request_id)
        return []

    def _change_loras(self, reply: asyncio.Future, method, *args) -> None:
        try:
            result, error = method(*args), None
        except LoraError as e:
            result, error = None, e
        except Exception as e:  # must not kill the engine thread
            logger.exception("LoRA %s failed", method.__name__)
            result, error = None, RuntimeError(f"{method.__name__} failed: {e}")
        if error is None:
            self.loras = dict(self._engine.loras.cards)
        answer(reply, result, error)

    def _embed(self, prompts: list[list[int]], reply: asyncio.Future) -> None:
        try:
            result, error = self._engine.embed(prompts), None
        except ValueError as e:
            result, error = None, e
        except Exception as e:  # must not kill the engine thread
            logger.exception("embedding failed")
            result, error = None, EngineDeadError(f"embedding failed: {e}")
        answer(reply, result, error)

    def _fail_all(self, message: str) -> list[Event]:
        """Abort every request in flight (beam searches included), each with a RequestFailed for its reader."""
        engine = self._engine
        failed = []
        for request_id in [*engine.requests, *engine.beams.groups]:
            if engine.abort_request(request_id) is not None:
                failed.append(RequestFailed(request_id, message, FailureKind.ENGINE_DEAD))
        return failed

    def _publish(self) -> None:
        snapshot = _snapshot(self._engine)
        with self._lock:
            self._stats = snapshot
            self._num_pending -= self._num_absorbed
            self._num_absorbed = 0

    def _deliver(self, events: list[Event]) -> None:
        for event in events:
            with self._lock:
                stream = self._streams.get(event.request_id)
            if stream is None:
                continue  # its reader went away
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more


def _snapshot(engine: Engine) -> EngineStats:
    """The engine's counters now; called on the thread that owns the engine."""
    bm = engine.block_manager
    spec = engine.speculator.counters if engine.speculator is not None else None
    return EngineStats(
        num_running=len(engine.scheduler.running),
        num_waiting=engine.num_waiting,
        num_free_blocks=bm.num_free_blocks,
        num_total_blocks=bm.num_blocks,
        num_prefix_cache_queries=bm.num_queried_tokens,
        num_prefix_cache_hits=bm.num_hit_tokens,
        num_pinned_blocks=bm.num_pinned_blocks,
        num_refused_pin_blocks=bm.num_refused_pin_blocks,
        num_steps=engine.num_steps,
        num_preemptions=engine.num_preemptions,
        num_generated_tokens=engine.num_generated_tokens,
        num_spec_drafts=spec.num_drafts if spec else 0,
        num_spec_draft_tokens=spec.num_draft_tokens if spec else 0,
        num_spec_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        num_spec_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
    )
