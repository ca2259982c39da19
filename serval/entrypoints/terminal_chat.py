"""`serval chat` and `serval complete`: the model from a terminal, against a server's URL or in-process.

Owns the terminal side: reading a message (a line ending in a backslash continues on the next; a line of
three double quotes opens a block that another such line closes), the commands (/reset, /system TEXT,
/help, /exit), showing an answer as it streams (reasoning dim on a terminal, tool calls by name and
arguments) and a timing line after it (time to first token, tokens, tokens/s, cached prompt tokens), and
`complete`'s one prompt from stdin to stdout. The wire is chat_client.py's; `--model PATH` serves the model
in this process first (local_server.py). Options are parsed by cli.py, which calls `add_parsers` and `main`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from serval.entrypoints.chat_client import DEFAULT_URL, Answer, APIClient, ChatError

DIM, RESET = "\x1b[2m", "\x1b[0m"
BLOCK = '"""'
HELP = """commands: /reset (forget the conversation), /system TEXT (set the system prompt; /system alone clears
it), /help, /exit (or Ctrl+D). A line ending in \\ continues on the next; a line of \"\"\" opens a block that
another closes. Ctrl+C stops an answer."""


def add_parsers(subparsers: Any) -> None:
    """The `chat` and `complete` sub-commands (cli.py owns the parser)."""
    for name, help_text in (
        ("chat", "chat with the model from a terminal"),
        ("complete", "complete the prompt read from stdin, print it to stdout"),
    ):
        p = subparsers.add_parser(name, help=help_text)
        p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
        p.add_argument("--api-key", help="bearer key (default: $SERVAL_API_KEY)")
        p.add_argument("--model", help="serve this model (.gguf or HF directory) in this process instead")
        p.add_argument("--dtype", default="auto", help="with --model: as serve's --dtype (default auto)")
        p.add_argument("--model-name", help="the `model` of requests (default: the server's first)")
        p.add_argument("--max-tokens", type=int, help="most tokens an answer may have")
        p.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    subparsers.choices["chat"].add_argument("--system-prompt", help="the conversation's system prompt")
    subparsers.choices["complete"].add_argument(
        "--chat", action="store_true", help="send the prompt as a user message and print the answer"
    )


@contextlib.contextmanager
def connect(args: argparse.Namespace) -> Iterator[tuple[APIClient, str]]:
    """A client of the server (started here with --model), and the model name its requests use."""
    local = None
    url = args.url
    if args.model is not None:
        from serval.entrypoints.local_server import LocalServer

        local = LocalServer.start(args.model, args.dtype)
        url = local.url
    client = APIClient(url, args.api_key)
    try:
        yield client, args.model_name or client.models()[0]
    finally:
        client.close()
        if local is not None:
            local.stop()


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {name: value for name, value in options.items() if value is not None}


class Screen:
    """Where an answer goes: stdout, with reasoning dim and a timing line when it is a terminal."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err
        self.is_terminal = out.isatty() and "NO_COLOR" not in os.environ
        self.mode = ""  # the kind of piece shown last

    def piece(self, kind: str, text: str) -> None:
        if kind != self.mode:
            self._switch(kind)
        self.out.write(text)
        self.out.flush()

    def _switch(self, kind: str) -> None:
        if self.mode == "reasoning" and self.is_terminal:
            self.out.write(RESET)
        if kind == "tool_arguments" and self.mode == "tool_call":
            self.out.write(" ")  # the arguments follow the call's name on its line
        else:
            if self.mode:
                self.out.write("\n")
            if kind == "reasoning":
                self.out.write(DIM if self.is_terminal else "[reasoning]\n")
            elif kind == "tool_call":
                self.out.write("[tool call] ")
            elif kind == "tool_arguments":
                self.out.write("[tool call arguments] ")
            elif self.mode == "reasoning" and not self.is_terminal:
                self.out.write("[answer]\n")
        self.mode = kind

    def end(self, answer: Answer | None, note: str = "") -> None:
        if self.mode == "reasoning" and self.is_terminal:
            self.out.write(RESET)
        self.out.write("\n")
        self.out.flush()
        self.mode = ""
        if answer is not None:
            line = timing_line(answer) + note
            self.err.write(f"{DIM}{line}{RESET}\n" if self.is_terminal else line + "\n")
            self.err.flush()


def timing_line(answer: Answer) -> str:
    usage = answer.usage
    parts = []
    if answer.ttft_s is not None:
        parts.append(f"TTFT {answer.ttft_s:.2f} s")
    parts.append(f"{usage.get('completion_tokens', '?')} tokens")
    if answer.tokens_per_s is not None:
        parts.append(f"{answer.tokens_per_s:.1f} tokens/s")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached:
        parts.append(f"{cached} cached prompt tokens")
    return "[" + ", ".join(parts) + "]"


def read_message(read_line: Callable[[str], str], is_terminal: bool) -> str:
    """One message: a line, lines joined by a trailing backslash, or a \"\"\" block. EOFError at the end."""
    prompt, more = (">>> ", "... ") if is_terminal else ("", "")
    line = read_line(prompt)
    if line.strip() == BLOCK:
        lines = []
        while (line := read_line(more)).strip() != BLOCK:
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line(more)
    return "\n".join([*lines, line])


class Conversation:
    def __init__(self, system_prompt: str | None) -> None:
        self.system_prompt = system_prompt
        self.turns: list[dict[str, Any]] = []

    def messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + self.turns

    def command(self, text: str, err: TextIO) -> bool:
        """Run a /command; False to end the chat."""
        name, _, rest = text.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.turns.clear()
            err.write("[conversation cleared]\n")
        elif name == "/system":
            self.system_prompt = rest.strip() or None
            err.write(f"[system prompt {'set' if self.system_prompt else 'cleared'}]\n")
        else:
            err.write(HELP + "\n")
        return True


def chat(
    args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    is_terminal = stdin.isatty()
    if is_terminal:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
        # Ctrl+C stops an answer, whatever SIGINT's inherited disposition: a process started in the
        # background by a non-interactive shell (`cmd &` in a script, a test run) inherits SIGINT ignored, and
        # Python then installs no KeyboardInterrupt handler, so the interrupt was lost and the answer ran on.
        with contextlib.suppress(ValueError):  # not the main thread (an embedding caller): leave it
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def read_line(prompt: str) -> str:
        if is_terminal:
            return input(prompt)
        line = stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    screen = Screen(out, err)
    conversation = Conversation(args.system_prompt)
    with connect(args) as (client, model):
        if is_terminal:
            err.write(f"chatting with {model} at {client.http.base_url}; /help for commands\n")
        while True:
            try:
                text = read_message(read_line, is_terminal)
            except EOFError:
                return 0
            except KeyboardInterrupt:
                err.write("\n")
                continue
            if text.startswith("/") and not text.startswith("//"):
                if not conversation.command(text.strip(), err):
                    return 0
                continue
            if not text.strip():
                continue
            conversation.turns.append({"role": "user", "content": text.removeprefix("/")})
            body = {"model": model, "messages": conversation.messages(), **sampling(args)}
            answer = _answer(client, "/v1/chat/completions", body, screen, err)
            if answer is None or not (answer.content or answer.tool_calls):
                conversation.turns.pop()  # refused or stopped at once: not part of the conversation
            else:
                conversation.turns.append({"role": "assistant", "content": answer.content})


def _answer(client: APIClient, path: str, body: dict[str, Any], screen: Screen, err: TextIO) -> Answer | None:
    """The streamed answer (what came of it, when Ctrl+C stopped it), or None when it was refused."""
    answer = Answer()
    try:
        client.stream(path, body, screen.piece, answer)
        screen.end(answer)
    except KeyboardInterrupt:  # the connection is closed, so the server cancels the request
        screen.end(None)
        err.write("[stopped]\n")
    except ChatError as e:
        screen.end(None)
        err.write(f"error: {e}\n")
        return None
    return answer


def complete(
    args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    prompt = stdin.read()
    if not prompt.strip():
        err.write("serval complete: error: no prompt on stdin\n")
        return 2
    with connect(args) as (client, model):
        if args.chat:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        else:
            path, body = "/v1/completions", {"prompt": prompt}
        body = {"model": model, **body, **sampling(args)}
        try:
            client.stream(path, body, lambda kind, text: (out.write(text), out.flush()))
        except ChatError as e:
            err.write(f"serval complete: error: {e}\n")
            return 1
        out.write("\n")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return chat(args) if args.command == "chat" else complete(args)
    except ChatError as e:  # the server could not be reached, or refused the key
        sys.stderr.write(f"serval {args.command}: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
