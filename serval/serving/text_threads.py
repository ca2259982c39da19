"""TextThreads: chat-template rendering and tokenization of long inputs, run off the event loop.

Owns where text work runs. Tokenizing a prompt of megabytes takes seconds on a CPU (3 MiB of English words:
~3 s on one Zen 2 core); on the event loop that stalls every other request's stream, /health and /metrics for as
long. The Hugging Face tokenizers library releases the GIL while it encodes a batch (serving/tokenizer.py
encodes every text as a batch of one), so a worker thread frees the loop for real: beside a 3 MiB encode in a
thread the loop ran 236 times in 2.6 s, its longest pause 0.14 s. Short inputs stay inline: a hop to a thread
and back costs more than tokenizing a chat message.

What must hold: what runs here touches nothing shared that is not thread-safe. The chat template's render
keeps its state per call (ClientTexts), the tokenizer's backend is immutable Rust, the executor's threads are
the only extra threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any, TypeVar

# Characters of text below which rendering and tokenizing stay on the event loop (~4,000 tokens, a few ms).
INLINE_TEXT_CHARS = 16 * 1024

T = TypeVar("T")


class TextThreads:
    """A small thread pool for text work, used only when the text is long."""

    def __init__(self, num_threads: int = 2, inline_chars: int = INLINE_TEXT_CHARS) -> None:
        self.inline_chars = inline_chars
        # Threads start on first use: most deployments never see a prompt this long.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="serval-text"
        )

    async def run(self, num_chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs), inline when num_chars is small, otherwise in a thread (exceptions come back as
        they were raised)."""
        if num_chars <= self.inline_chars:
            return fn(*args, **kwargs)
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def num_message_chars(messages: list[dict[str, Any]]) -> int:
    """About how much text the messages hold: their string fields (content, reasoning, names). Tool-call
    arguments and tools are small next to a content long enough to matter."""
    return sum(len(value) for message in messages for value in message.values() if isinstance(value, str))
