"""EngineClient: the seam between an asyncio front end and the engine running on its own thread.

The engine thread owns the Engine: only it calls add/abort/step. The event loop talks to it through a
command queue, and gets each request's deltas back on a RequestStream of its own. Closing a stream before it
finished (a client that went away) aborts its request, whose blocks are freed at the next step.

Admission is all or nothing: `add_requests` takes every sequence of one API request (n, best_of, several
prompts) at once, checks them all against the prompt rules and the waiting queue's free room, and either
hands them to the engine thread as one command (added together, before any step runs one) or raises before
anything is queued. So a refused request leaves nothing running and no KV block held.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serval.config import EngineConfig
from serval.engine.constraint import TokenConstraint
from serval.engine.engine import Engine
from serval.engine.lora import LoraCard, LoraError, UnknownLoraError
from serval.engine.outputs import RequestOutput
from serval.runner.runner import RunnerInfo
from serval.sampling import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine has stopped, or a step failed and took the requests in flight with it."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int  # of those, tokens found
    num_steps: int
    num_preemptions: int
    num_generated_tokens: int
    num_pinned_blocks: int = 0  # blocks held by explicit-cache pins (cache_control)
    num_refused_pin_blocks: int = 0  # blocks pins asked for past --max-pinned-kv-fraction, left unpinned

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True)
class NewRequest:
    """One engine request to add: what `Engine.add_request` takes, as one value (filled by serving)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    constraint: TokenConstraint | None = None  # serving's grammar matcher, one per request
    num_pinned_prompt_tokens: int = 0  # leading prompt tokens to pin in the explicit cache
    # Another request of the same add_requests call with the same prompt (n / best_of) whose prompt blocks
    # this one forks instead of computing them again.
    share_prompt_with: str | None = None
    lora_name: str | None = None  # a loaded LoRA adapter; None: the base model


class RequestStream:
    """The outputs of one admitted request, read on the event loop: iterate it once. close() aborts the
    request unless it finished; it never awaits (safe in a cancelled scope) and may be called again."""

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()  # RequestOutputs, or an exception to raise
        self.is_finished = False
        self._client = client
        self._is_closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.is_finished:
                output = await self.queue.get()
                if isinstance(output, Exception):
                    self.is_finished = True
                    raise output
                if output.error is not None and output.finish_reason == "abort":
                    self.is_finished = True
                    raise ValueError(output.error)
                self.is_finished = output.finished
                yield output
        finally:
            self.close()

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._client._forget(self.request_id)
        if not self.is_finished:
            self._client.abort(self.request_id)


class EngineClient:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.runner.info.vocab_size  # the logits' width (may exceed the tokenizer's)
        # What is served and how (architecture, weight format, kernels, KV cache), fixed once loaded: the
        # layers above read the runner's facts here (start-up log, /metrics, /version), never from the runner.
        self.runner_info: RunnerInfo = engine.runner.info
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and _num_pending
        self._num_pending = 0  # requests sent to the engine thread but not yet taken by it
        self._stopped = threading.Event()
        # The loaded adapters, for the event loop to read without a lock: the engine thread replaces the
        # dict whole after each load or unload (copy on write), never changes it in place.
        self.loras: dict[str, LoraCard] = dict(engine.loras.cards)
        self._thread = threading.Thread(target=self._run, name="serval-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig) -> EngineClient:
        # NOTE: the engine is built on a helper thread, not the caller's (the main one). Once the main thread
        # has run an OpenMP parallel region (loading the weights runs many), every region another thread
        # starts costs ~50 us more (libgomp; measured: an elementwise op 27 -> 75 us, a 137-token prefill
        # 64 -> 100+ ms on the engine thread). Built elsewhere, the main thread never runs one.
        built: dict[str, object] = {}

        def build() -> None:
            try:
                built["engine"] = Engine(config)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
                built["error"] = e
            _release_freed_memory()

        builder = threading.Thread(target=build, name="serval-engine-load")
        builder.start()
        builder.join()
        if "error" in built:
            raise built["error"]
        return cls(built["engine"])

    # ---- event-loop side

    def add_requests(self, requests: list[NewRequest]) -> list[RequestStream]:
        """Admit all of `requests` or none. Raises before anything is queued: ValueError (a prompt the
        context can't hold, a request id in use, more requests than the queue could ever hold),
        UnknownLoraError, QueueFullError (the waiting queue has no room for all of them), EngineDeadError."""
        if self._stopped.is_set():
            raise EngineDeadError("the engine has stopped")
        for request in requests:
            self.engine.check_prompt(len(request.prompt_token_ids), request.params)  # with the numbers
            if request.lora_name is not None and request.lora_name not in self.loras:
                # Checked again on the engine thread: an unload may get there first (also UnknownLoraError).
                raise UnknownLoraError(f"the LoRA adapter {request.lora_name!r} is not loaded")
        ids = [request.request_id for request in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be distinct")
        max_queue_len = self.engine.config.scheduler.max_queue_len
        if len(requests) > max_queue_len:
            raise ValueError(
                f"{len(requests)} sequences at once can never be admitted: at most {max_queue_len} may wait"
            )
        streams = [RequestStream(self, request_id) for request_id in ids]
        with self._lock:
            # Every new request counts as waiting until the engine schedules it: the whole request must fit.
            num_waiting = self.engine.num_waiting + self._num_pending
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
        self._commands.put(("add", list(requests)))
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
        self._commands.put(("abort", request_id))

    def _forget(self, request_id: str) -> None:
        # Its outputs have no reader any more (see RequestStream.close).
        with self._lock:
            self._streams.pop(request_id, None)

    async def load_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoraCard:
        """Read and check the adapter off the engine thread, then copy it into a slot on it. LoraError (or
        its subclasses) for a bad adapter, a taken name, no free slot."""
        self.engine.loras.check_can_add(name)  # fail fast; the engine thread checks again
        try:
            adapter = await asyncio.to_thread(self.engine.runner.read_lora, path)
        except ValueError as e:
            raise LoraError(str(e)) from e
        return await self._call_engine(self.engine.add_lora, name, adapter, base_model_name)

    async def unload_lora(self, name: str) -> LoraCard:
        """UnknownLoraError if not loaded, LoraConflictError while requests use it."""
        return await self._call_engine(self.engine.remove_lora, name)

    async def _call_engine(self, method, *args) -> LoraCard:
        # Runs method(*args) on the engine thread, between steps, and hands back its result or LoraError.
        if self._stopped.is_set():
            raise EngineDeadError("the engine has stopped")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", method, args, future))
        return await future

    def stats(self) -> EngineStats:
        engine = self.engine
        bm = engine.block_manager
        return EngineStats(
            num_running=len(engine.scheduler.running),
            num_waiting=engine.num_waiting + self._num_pending,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_prefix_cache_queries=bm.num_queried_tokens,
            num_prefix_cache_hits=bm.num_hit_tokens,
            num_pinned_blocks=bm.num_pinned_blocks,
            num_refused_pin_blocks=bm.num_refused_pin_blocks,
            num_steps=engine.num_steps,
            num_preemptions=engine.num_preemptions,
            num_generated_tokens=engine.num_generated_tokens,
        )

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    # ---- engine-thread side

    def _run(self) -> None:
        while not self._stopped.is_set():
            # Block for work when idle; otherwise just drain what arrived during the last step.
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            if self._stopped.is_set():
                break
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a failed step must not kill the server
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all("internal error while generating")
                continue
            for output in outputs:
                self._deliver(output)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1])
        elif kind == "abort":
            output = self.engine.abort_request(command[1])
            if output is not None:
                self._deliver(output)
        elif kind == "call":
            _, method, args, future = command
            try:
                result, error = method(*args), None
            except LoraError as e:
                result, error = None, e
            except Exception as e:  # must not kill the engine thread
                logger.exception("LoRA %s failed", method.__name__)
                result, error = None, RuntimeError(f"{method.__name__} failed: {e}")
            if error is None:
                self.loras = dict(self.engine.loras.cards)
            _resolve(future, result, error)

    def _add(self, requests: list[NewRequest]) -> None:
        """Add one add_requests call's requests together, between steps; if the engine refuses one, none."""
        with self._lock:
            self._num_pending -= len(requests)
            # A caller that went away before the engine saw its requests closed their streams.
            wanted = [request for request in requests if request.request_id in self._streams]
        added: list[str] = []
        for request in wanted:
            try:
                self.engine.add_request(
                    request.request_id, request.prompt_token_ids, request.params, request.eos_token_ids,
                    request.constraint, request.num_pinned_prompt_tokens, request.share_prompt_with,
                    lora_name=request.lora_name,
                )  # fmt: skip
            except ValueError as e:  # UnknownLoraError included: unloaded since add_requests checked
                # No step has run since the first of them was added: aborting them frees nothing yet held.
                for request_id in added:
                    self.engine.abort_request(request_id)
                failure = e if isinstance(e, UnknownLoraError) else None  # raised as such by the stream
                for other in wanted:
                    self._deliver(
                        _error_output(other.request_id, len(other.prompt_token_ids), str(e)), failure
                    )
                return
            added.append(request.request_id)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self.engine.requests):
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(output, EngineDeadError(message))

    def _deliver(self, output: RequestOutput, failure: Exception | None = None) -> None:
        # A failure is delivered in place of the output: generate() raises it in the caller.
        with self._lock:
            stream = self._streams.get(output.request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, failure or output)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more


def _release_freed_memory() -> None:
    """Hand the loader's freed fp32 buffers back to the OS (glibc keeps them in the loading thread's malloc
    arena: ~300 MB of resident memory for the default model otherwise). A no-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _resolve(future: asyncio.Future, result, error: Exception | None) -> None:
    def settle() -> None:
        if future.done():
            return  # the caller went away
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody is waiting any more


def _error_output(request_id: str, num_prompt_tokens: int, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_logprobs=None,
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=0,
        num_output_tokens=0,
        finished=True,
        finish_reason="abort",
        error=message,
    )
