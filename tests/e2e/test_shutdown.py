"""Graceful SIGTERM on a real server process, read through the `openai` client: new connections are refused
while it drains, a stream in flight runs to its end within the grace period (or, past a short one, is cut
off with a last chunk, usage and [DONE]), and the process exits 0."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import running_server
from tests.e2e.helpers import wait_for

# Real server processes with the default model: minutes, not seconds.
pytestmark = pytest.mark.slow

SHORT_GRACE_S = 1.0
EXIT_MARGIN_S = 5.0  # after the grace: the cut streams' last chunks, the engine thread, interpreter exit


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both started at once (the model loads overlap); each test ends its own with SIGTERM."""
    directory = tmp_path_factory.mktemp("shutdown")
    long_args, short_args = (
        ["--shutdown-grace-seconds", "120"],
        ["--shutdown-grace-seconds", str(SHORT_GRACE_S)],
    )
    with (
        running_server(long_args, directory / "long.log", wait=False) as long,
        running_server(short_args, directory / "short.log", wait=False) as short,
    ):
        yield {"long": long, "short": short}


def start_stream(server, max_tokens: int):
    server.wait_ready()
    model = server.served_model()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip


def new_request_status(server) -> str:
    try:
        return str(httpx.get(f"{server.base_url}/health", timeout=5).status_code)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        # RemoteProtocolError: the kernel took the connection into the listening socket's backlog just as
        # uvicorn stopped serving, and uvicorn closed it unanswered. Not served either: refused.
        return "refused"


def read_after_sigterm(server, stream) -> tuple[list, float]:
    """Read the first chunk, send SIGTERM, read the rest: (the chunks after the signal, when it was sent)."""
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].text is not None
    os.kill(server.process.pid, signal.SIGTERM)
    signalled = time.monotonic()
    # uvicorn notices the signal within 0.1 s; from then on a new request is refused.
    wait_for(lambda: new_request_status(server), lambda status: status in ("refused", "503"), 10, "refusing")
    return list(chunks), signalled  # an exception here would be a dropped connection


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(servers):
    server = servers["long"]
    stream = start_stream(server, max_tokens=300)
    rest, signalled = read_after_sigterm(server, stream)
    ended = time.monotonic()
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in rest if c.usage is not None]
    assert finishes == ["length"] and len(usage) == 1
    assert usage[0].completion_tokens == 300  # all of it: nothing was cut
    assert server.process.wait(timeout=30) == 0
    # It exits once the stream is done, not at the end of the 120 s grace period.
    assert time.monotonic() - ended < 15 and ended - signalled < 120
    log = server.log_tail()
    assert "shutting down: 1 generation(s) in flight" in log and "Traceback" not in log


def test_sigterm_cuts_a_stream_at_the_end_of_a_short_grace_period_and_exits_0(servers):
    server = servers["short"]
    stream = start_stream(server, max_tokens=4000)  # a minute or more, uncut
    rest, signalled = read_after_sigterm(server, stream)
    finishes = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in rest if c.usage is not None]
    assert finishes == ["length"] and len(usage) == 1  # a proper last chunk, then the usage, then [DONE]
    assert 1 < usage[0].completion_tokens < 4000
    assert len([c for c in rest if c.choices and c.choices[0].text]) > 0  # it kept streaming in the grace
    assert server.process.wait(timeout=SHORT_GRACE_S + 30) == 0
    assert time.monotonic() - signalled < SHORT_GRACE_S + EXIT_MARGIN_S
    assert "grace period over: cutting off 1 generation(s)" in server.log_tail()
