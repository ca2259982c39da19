"""`serval serve --tensor-parallel-size 2` on the default model: the real `openai` client gets the same greedy
answers as the one-process model, and a worker that dies stops the server with a clear line and exit 1."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from openai import OpenAI

from serval import LLM, SamplingParams
from tests.e2e.conftest import running_server
from tests.fixtures.prompts import PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("tp") / "server.log"
    with running_server(["-tp", "2", "--dtype", "float32", "--max-model-len", "1024"], log_path) as server:
        yield server


def _worker_pid(log: str) -> int:
    match = re.search(r"tensor parallel: 2 ranks, \d+ threads each, workers' pids \[(\d+)\]", log)
    assert match is not None, log
    return int(match.group(1))


def test_split_server_answers_as_the_whole_model(split_server):
    client = OpenAI(base_url=split_server.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    answers = [
        client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0).choices[0].text
        for prompt in PROMPTS[:2]
    ]
    whole = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=64)
    expected = whole.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12))
    assert answers == [out.outputs[0].text for out in expected]
    assert "in each of 2 tensor-parallel ranks" in split_server.log_tail()


def test_a_killed_worker_stops_the_server(split_server):
    os.kill(_worker_pid(split_server.log_tail()), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while split_server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert split_server.process.returncode == 1, split_server.log_tail()
    log = split_server.log_tail()
    assert "tensor-parallel worker rank 1" in log and "died with exit code -9" in log
    assert "serval: error: tensor-parallel worker rank 1" in log
