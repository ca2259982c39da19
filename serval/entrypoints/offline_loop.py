"""The offline LLM's pipeline: the server's own (an EngineClient on its engine thread, serving's Frontend, its
requests run by serving/run.py) driven from synchronous code.

Owns the event loop that pipeline needs: a loop of its own on a thread, so a call works the same whether or
not the caller's thread runs a loop of its own (a Jupyter cell does; `asyncio.run` fails there), and what an
interrupted call leaves behind: nothing (its engine requests are aborted before the call returns).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from serval.engine.client import EngineClient
from serval.engine.engine import Engine
from serval.serving.frontend import Frontend
from serval.serving.media.processor import MediaProcessor
from serval.serving.tokenizer import Tokenizer

T = TypeVar("T")


class OfflineLoop:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, media_processor: MediaProcessor | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="serval-llm-loop", daemon=True)
        self.thread.start()
        # Made on the loop: a Frontend's queues and locks belong to the loop that made them.
        self.client, self.frontend = self.run(_build(engine, tokenizer, media_processor))

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result, run on the pipeline's loop. Whatever ends it (its result, an error, Ctrl+C
        here), the engine thread has handled its aborts (a stop string's, a refusal's, the interrupt's) by the
        time this returns or raises."""
        task = asyncio.run_coroutine_threadsafe(_spawn(self._flushed(coroutine)), self.loop).result()
        try:
            return asyncio.run_coroutine_threadsafe(_wait(task), self.loop).result()
        except BaseException:
            asyncio.run_coroutine_threadsafe(_cancel(task), self.loop).result()
            raise

    async def _flushed(self, coroutine: Coroutine[Any, Any, T]) -> T:
        try:
            return await coroutine
        finally:
            with contextlib.suppress(Exception):  # EngineDeadError: stopped, nothing left to wait for
                await self.client.flush()

    def close(self) -> None:
        """Stop the engine thread (and a tensor-parallel runner's workers), then the loop."""
        self.client.shutdown()
        self.frontend.text_threads.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def _build(
    engine: Engine, tokenizer: Tokenizer, media_processor: MediaProcessor | None
) -> tuple[EngineClient, Frontend]:
    client = EngineClient(engine)
    # The server's rules without a deployment's extra caps (maxInputTokenLen, maxIterTimes, per-request
    # sequence limit): the context alone bounds a prompt and its answer.
    return client, Frontend(client, tokenizer, media_processor=media_processor)


async def _spawn(coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    return asyncio.get_running_loop().create_task(coroutine)


async def _wait(task: asyncio.Task[T]) -> T:
    return await task


async def _cancel(task: asyncio.Task) -> None:
    """Cancel the run and wait for it to end (its streams closed, their aborts handled)."""
    task.cancel()
    with contextlib.suppress(BaseException):  # its own error or the CancelledError: the caller has one
        await task
