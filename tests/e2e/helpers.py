"""Small helpers for the real-server tests: raw SSE reading, metric scraping, waiting on a state, and child
processes that end with the test run (and the CPU time they use)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

# prctl, looked up here rather than in the forked child: dlopen's lock may be held by another thread at fork.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def die_with_parent() -> None:
    """A subprocess.Popen preexec_fn: the child gets SIGKILL when the pytest process that started it dies, so a
    run stopped hard (a timeout, a kill) leaves no server holding a port and gigabytes behind. Linux only; a
    no-op elsewhere, where fixtures' own teardown is all there is. It only makes one system call through a
    function resolved before the fork, which is safe in a child forked from a threaded parent."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def sse_chunks(base_url: str, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """POST a streaming request; return the decoded chunks, checking the framing ([DONE] last, once)."""
    lines = []
    with httpx.stream("POST", base_url + path, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def metric(base_url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for(read: Callable[[], T], is_done: Callable[[T], bool], timeout: float, what: str) -> T:
    """Poll read() until is_done holds of its value, and return that value. `timeout` bounds a failure (an
    AssertionError naming `what` and the last value); it is no window the state must come within."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if is_done(value):
            return value
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s, the last read was {value!r}"
        time.sleep(0.1)


def wait_until_idle(
    base_url: str, headers: dict | None = None, timeout: float = 20.0, kv_usage: float = 0.0
) -> None:
    """Until no request runs or waits and no more of the KV cache than kv_usage is in use (none by default; the
    engine frees blocks at its next step)."""

    def read() -> dict[str, float]:
        names = ("serval_num_requests_running", "serval_num_requests_waiting", "serval_kv_cache_usage_perc")
        return {name: metric(base_url, name, headers) for name in names}

    def is_idle(values: dict[str, float]) -> bool:
        running, waiting, usage = values.values()
        return running == waiting == 0 and usage <= kv_usage

    wait_for(read, is_idle, timeout, "idle")


def cpu_seconds_below(pid: int) -> dict[int, float]:
    """CPU seconds (user and system) each process below `pid` has used so far, by pid (Linux's /proc): what
    shows a server's worker process (a grammar compile's) at work, where no endpoint does."""
    parent_of: dict[int, int] = {}
    cpu: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # After the command's closing parenthesis: state, ppid, ... utime and stime (fields 14, 15).
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        parent_of[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    below, frontier = {}, [pid]
    while frontier:
        parents = set(frontier)
        frontier = [child for child, parent in parent_of.items() if parent in parents]
        below.update((child, cpu[child]) for child in frontier)
    return below
