"""Real `serval serve` processes on loopback, each on a free port, stopped by pid at the end of the session.

Two servers, started together (model loading dominates the suite's time, and the two loads overlap):
`server` with the default flags, and `deploy_server` configured from a MindIE config.json plus API keys,
one running request at a time, a one-request queue, a short request timeout and room for long generations
(so that the timeout, not the token cap, ends them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.e2e.helpers import die_with_parent

SERVAL = [sys.executable, "-m", "serval.entrypoints.cli"]  # the `serval` command, in this interpreter
STARTUP_TIMEOUT_S = 240
API_KEYS = ("key-one", "key-two")
DEPLOY_MODEL = "smol"
DEPLOY_TIMEOUT_S = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: str
    model: str = ""
    tls: ssl.SSLContext | None = None  # when it speaks HTTPS: a context that trusts its certificate

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until /health answers 200; RuntimeError with the log's tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=1, verify=self.tls or True)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)  # a poll interval, not a wait for something to happen
        raise RuntimeError(f"the server did not start in {timeout_s}s:\n{self.log_tail()}")

    def served_model(self, headers: dict | None = None) -> str:
        """The first model /v1/models lists."""
        response = httpx.get(f"{self.base_url}/v1/models", headers=headers, verify=self.tls or True)
        return response.json()["data"][0]["id"]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


@contextlib.contextmanager
def running_server(
    args: list[str],
    log_path: str | os.PathLike,
    *,
    wait: bool = True,
    timeout_s: float = STARTUP_TIMEOUT_S,
    tls: ssl.SSLContext | None = None,
    program: list[str] = SERVAL,
    stdout_to_log: bool = True,
) -> Iterator[Server]:
    """A real `serval serve` (args after --host/--port) on a free loopback port, ready (/health answers) unless
    wait is False (then the caller waits, so that several servers load at once); stopped by its pid when the
    block ends, whether the test passed or not."""
    port = free_port()
    command = [*program, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:  # stderr, and stdout too unless stdout_to_log is False
        process = subprocess.Popen(
            command,
            stdout=log if stdout_to_log else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if stdout_to_log else log,
            preexec_fn=die_with_parent,  # noqa: PLW1509 (one prctl call)
        )
    server = Server(process, port, str(log_path), tls=tls)
    try:
        if wait:
            server.wait_ready(timeout_s)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("servers")
    config = {
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 1025, "httpsEnabled": False, "fullTextEnabled": True,
                         "e2eTimeout": DEPLOY_TIMEOUT_S},
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": 2048, "maxInputTokenLen": 1024,
                                  "ModelConfig": [{"modelName": DEPLOY_MODEL}]},
            "ScheduleConfig": {"maxBatchSize": 1, "maxIterTimes": 1500, "maxQueueLen": 1},
        },
    }  # fmt: skip
    config_path = directory / "config.json"
    config_path.write_text(json.dumps(config))
    # fp32 (dense weights): these tests were written against it and compare greedy outputs alone and inside
    # a batch; the default flags' bitwise batch invariance (packed weights) is test_batch_invariance.py's.
    main_args = ["--log-level", "warning", "--dtype", "float32"]
    deploy_args = ["--config", str(config_path), "--log-level", "warning"]
    for key in API_KEYS:
        deploy_args += ["--api-key", key]
    with (
        running_server(main_args, directory / "main.log", wait=False) as main,
        running_server(deploy_args, directory / "deploy.log", wait=False) as deploy,
    ):
        yield {"main": main, "deploy": deploy}


@pytest.fixture(scope="session")
def server(_servers) -> Server:
    server = _servers["main"]
    server.wait_ready()
    if not server.model:
        server.model = server.served_model()
    return server


@pytest.fixture(scope="session")
def deploy_server(_servers) -> Server:
    server = _servers["deploy"]
    server.wait_ready()
    server.model = DEPLOY_MODEL
    return server


# The browser-facing server: an API key, CORS for one origin with credentials (the playground, serval chat and
# the CORS tests share it). Started on first use only. Its ChatML template opens a <think> block when a request
# asks for it (chat_template_kwargs.enable_thinking), so the default model's answer starts as reasoning and
# thinking_budget closes it: real reasoning_content for the playground to fold, from a model that has none.
KEYED_API_KEY = "playground-key"
KEYED_ORIGIN = "http://app.example"
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory) -> Server:
    directory = tmp_path_factory.mktemp("keyed-server")
    template = directory / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    args = ["--api-key", KEYED_API_KEY, "--allowed-origins", json.dumps([KEYED_ORIGIN]), "--allow-credentials",
            "--dtype", "float32", "--chat-template", str(template)]  # fmt: skip
    with running_server(args, directory / "keyed.log") as server:
        server.model = server.served_model(headers={"Authorization": f"Bearer {KEYED_API_KEY}"})
        yield server


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
