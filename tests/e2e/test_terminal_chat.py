"""`serval chat` and `serval complete` as a user runs them, against a real server on loopback: through pipes
the answers are exactly the server's greedy answers to the same conversations (the commands, continuation
lines and blocks shaping them as documented); on a pseudo-terminal the prompts, the dim timing line and
Ctrl+C stopping an answer (the server cancels it); `complete` from a pipe, on a URL and in-process."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from serval.model_source import resolve_model
from tests.e2e.conftest import KEYED_API_KEY
from tests.e2e.helpers import wait_until_idle

# A real server process with the default model.
pytestmark = pytest.mark.slow

SERVAL = [sys.executable, "-m", "serval.entrypoints.cli"]
MAX_TOKENS = 12
TIMING = re.compile(r"\[TTFT \d+\.\d\d s, (\d+) tokens(, [\d.]+ tokens/s)?(, \d+ cached prompt tokens)?\]")
AUTH = {"Authorization": f"Bearer {KEYED_API_KEY}"}
TYPED = (
    "What is the capital of France?",
    "/system You answer in one short sentence.",
    "Name a colour \\",
    "of the sky.",
    '"""',
    "Two lines:",
    "/reset is not a command here",
    '"""',
    "/reset",
    "Hi",
    "/help",
    "//slash stays text",
)


@pytest.fixture(scope="module")
def client(keyed_server):
    return OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEYED_API_KEY, max_retries=0, timeout=120)


def greedy_chat(client, model: str, messages: list[dict]) -> str:
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    return response.choices[0].message.content


def run(args: list[str], stdin: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SERVAL, *args], input=stdin, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_chat_through_pipes_is_the_servers_greedy_conversation(keyed_server, client):
    model = keyed_server.model
    typed = "\n".join(TYPED)
    result = run(["chat", "--url", keyed_server.base_url, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"],
                 typed + "\n", env={"SERVAL_API_KEY": KEYED_API_KEY})  # fmt: skip
    assert result.returncode == 0, result.stderr
    system = {"role": "system", "content": "You answer in one short sentence."}
    turns: list[dict] = []
    expected = []
    for system_messages, text in (
        ([], "What is the capital of France?"),
        ([system], "Name a colour \nof the sky."),
        ([system], "Two lines:\n/reset is not a command here"),
        (None, "Hi"),  # after /reset: the system prompt stays, the turns go
        ([system], "/slash stays text"),
    ):
        if system_messages is None:
            turns, system_messages = [], [system]
        turns.append({"role": "user", "content": text})
        answer = greedy_chat(client, model, system_messages + turns)
        turns.append({"role": "assistant", "content": answer})
        expected.append(answer)
    assert result.stdout == "".join(answer + "\n" for answer in expected)
    timings = TIMING.findall(result.stderr)
    assert len(timings) == len(expected)
    assert all(1 <= int(tokens) <= MAX_TOKENS for tokens, _, _ in timings)
    assert "[system prompt set]" in result.stderr and "[conversation cleared]" in result.stderr
    assert "/reset (forget the conversation)" in result.stderr  # /help
    assert "\x1b[" not in result.stdout + result.stderr  # no terminal codes into a pipe


def test_complete_from_a_pipe(keyed_server, client):
    prompt = "The three primary colours are"
    expected = client.completions.create(
        model=keyed_server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    result = run(["complete", "--url", keyed_server.base_url + "/v1", "--api-key", KEYED_API_KEY, "--max-tokens",
                  str(MAX_TOKENS), "--temperature", "0"], prompt)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.choices[0].text + "\n"
    chat = run(["complete", "--chat", "--url", keyed_server.base_url, "--api-key", KEYED_API_KEY, "--max-tokens",
                str(MAX_TOKENS), "--temperature", "0"], "What is the capital of France?")  # fmt: skip
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert chat.stdout == greedy_chat(client, keyed_server.model, messages) + "\n"


def test_complete_in_process_matches_the_server(keyed_server, client):
    prompt = "Once upon a time"
    expected = client.completions.create(
        model=keyed_server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    # The server runs fp32 (its fixture): the same dtype here makes greedy text comparable.
    result = run(["complete", "--model", resolve_model(None).path, "--dtype", "float32", "--max-tokens",
                  str(MAX_TOKENS), "--temperature", "0"], prompt)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.choices[0].text + "\n"


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_a_bad_key_is_one_clear_line(keyed_server, command):
    result = run([command, "--url", keyed_server.base_url, "--api-key", "wrong"], "Hi\n")
    assert result.returncode == 1
    assert result.stderr.strip() == f"serval {command}: error: 401: invalid API key"


# `serval chat` exec'd with SIGINT ignored (an ignored disposition survives exec; the pid stays the same).
SERVAL_SIGINT_IGNORED = [
    sys.executable, "-c", ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN);"
    " os.execv(sys.executable, [sys.executable, '-m', 'serval.entrypoints.cli', *sys.argv[1:]])"),
]  # fmt: skip


def test_chat_on_a_terminal_and_ctrl_c_stops_an_answer(keyed_server):
    # The chat starts with SIGINT ignored, as anything started in the background by a non-interactive shell
    # does (a suite run as `make test &`): Python then installs no KeyboardInterrupt handler, and before the
    # chat installed its own, Ctrl+C was lost and the answer ran on to its 1,000 tokens.
    primary, secondary = os.openpty()
    process = subprocess.Popen(
        [*SERVAL_SIGINT_IGNORED, "chat", "--url", keyed_server.base_url, "--api-key", KEYED_API_KEY,
         "--max-tokens", "1000", "--temperature", "0"], stdin=secondary, stdout=secondary, stderr=secondary,
        env={**os.environ, "TERM": "dumb"},
    )  # fmt: skip
    os.close(secondary)
    screen = Terminal(primary)
    try:
        screen.wait_for(">>> ")
        screen.type("What is the capital of France?\n")
        screen.wait_for("tokens")  # the timing line, dim
        assert re.search(r"\x1b\[2m\[TTFT [^\n]*tokens[^\n]*\]\x1b\[0m", screen.text)
        assert "Paris" in screen.text
        screen.wait_for(">>> ", after=screen.text.index("TTFT"))
        start = len(screen.text)
        screen.type("Tell me a long story about a dragon.\n")
        screen.wait_for(" ", after=start + 60)  # well into the answer
        wait_for_running(keyed_server, 1)
        os.kill(process.pid, signal.SIGINT)
        screen.wait_for("[stopped]")
        wait_for_running(keyed_server, 0)  # the server cancelled it
        screen.wait_for(">>> ", after=screen.text.index("[stopped]"))
        screen.type("/exit\n")
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(primary)
    wait_until_idle(keyed_server.base_url, AUTH)


def wait_for_running(server, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    pattern = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.MULTILINE)
    while True:
        text = httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=10).text
        if float(pattern.search(text).group(1)) == count:
            return
        assert time.monotonic() < deadline, f"running never became {count}"
        time.sleep(0.05)


class Terminal:
    """The other end of a pseudo-terminal: everything the program wrote so far, and typing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_for(self, needle: str, after: int = 0, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text[after:]:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{needle!r} never came; the screen:\n{self.text[-2000:]}"
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 0.5))
            if ready:
                try:
                    self.text += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the program ended
                    break
