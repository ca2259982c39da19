"""A small streaming client of this server's HTTP API, for `serval chat` and `serval complete`.

Owns the wire side of the terminal tools: the base URL (with or without /v1), the bearer key, reading an SSE
stream into pieces as they come (content, reasoning, tool calls) while timing it, and turning a refusal, in
the OpenAI error shape before the stream or in-band after it, into one ChatError with the server's message.
Uses httpx only; knows nothing of serval's insides, so it works against any OpenAI-compatible server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx  # imported where a client is made: `serval serve` builds its parser from this module too

DEFAULT_URL = "http://127.0.0.1:8000"


class ChatError(Exception):
    """The server refused or failed the request (its message), or could not be reached."""


@dataclass
class Answer:
    """One streamed answer, folded, with its timing as the client saw it."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"} by index
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    ttft_s: float | None = None  # request sent -> first generated piece
    elapsed_s: float = 0.0  # request sent -> last piece
    last_piece_s: float | None = None  # request sent -> last generated piece

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: the tokens after the first over the time they took."""
        num_tokens = self.usage.get("completion_tokens") or 0
        if num_tokens < 2 or self.ttft_s is None or self.last_piece_s is None:
            return None
        span = self.last_piece_s - self.ttft_s
        return (num_tokens - 1) / span if span > 0 else None


# (kind, text): kind "content", "reasoning", "tool_call" (a call's name) or "tool_arguments" (a piece of them)
OnPiece = Callable[[str, str], None]


def base_url(url: str) -> str:
    """http://host:port or http://host:port/v1 (as the openai SDK takes it) -> http://host:port."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


class APIClient:
    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url(url), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def models(self) -> list[str]:
        """The served model names, then any LoRA adapters (GET /v1/models)."""
        response = self._send("GET", "/v1/models")
        return [card["id"] for card in response.json()["data"]]

    def stream(
        self, path: str, body: dict[str, Any], on_piece: OnPiece, answer: Answer | None = None
    ) -> Answer:
        """POST a streaming request to /v1/chat/completions or /v1/completions, folded into `answer` (which
        holds what came when Ctrl+C interrupts); `on_piece` sees every piece as it arrives. Leaving early
        closes the connection, which cancels the request."""
        import httpx

        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        answer = Answer() if answer is None else answer
        start = time.monotonic()
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ChatError(_error_message(response))
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    self._fold(json.loads(data), answer, on_piece, time.monotonic() - start)
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach {self.http.base_url}: {e}") from e
        answer.elapsed_s = time.monotonic() - start
        return answer

    def _fold(self, chunk: dict[str, Any], answer: Answer, on_piece: OnPiece, now_s: float) -> None:
        if "error" in chunk:  # a failure after the stream began
            raise ChatError(str(chunk["error"].get("message", chunk["error"])))
        if chunk.get("usage"):
            answer.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            pieces = _pieces(choice, answer)
            for kind, text in pieces:
                on_piece(kind, text)
            if pieces:
                answer.ttft_s = now_s if answer.ttft_s is None else answer.ttft_s
                answer.last_piece_s = now_s
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason

    def _send(self, method: str, path: str) -> httpx.Response:
        import httpx

        try:
            response = self.http.request(method, path)
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach {self.http.base_url}: {e}") from e
        if response.status_code >= 400:
            raise ChatError(_error_message(response))
        return response


def _pieces(choice: dict[str, Any], answer: Answer) -> list[tuple[str, str]]:
    """A chat delta (content, reasoning_content, tool_calls) or a completion's text, folded into `answer`."""
    pieces = []
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        delta = {"content": choice.get("text")}
    if delta.get("reasoning_content"):
        answer.reasoning += delta["reasoning_content"]
        pieces.append(("reasoning", delta["reasoning_content"]))
    if delta.get("content"):
        answer.content += delta["content"]
        pieces.append(("content", delta["content"]))
    for call in delta.get("tool_calls") or ():
        index = call.get("index", 0)
        while len(answer.tool_calls) <= index:
            answer.tool_calls.append({"name": "", "arguments": ""})
        function = call.get("function") or {}
        if function.get("name"):
            answer.tool_calls[index]["name"] += function["name"]
            pieces.append(("tool_call", function["name"]))
        if function.get("arguments"):
            answer.tool_calls[index]["arguments"] += function["arguments"]
            pieces.append(("tool_arguments", function["arguments"]))
    return pieces


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"{response.status_code}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}: {response.text[:200]}"
