"""A request's sequences are admitted together or not at all (in process, scripted engine): past
--max-seqs-per-request a 400 naming what asked for too many, a full queue a 429 for the whole request, and in
neither case does a single engine request start. While the server drains for a shutdown, every new request
is a 503."""

from __future__ import annotations

import json

import pytest

from serval.entrypoints.cli import build_parser, merged_options, server_config
from tests.api.conftest import MODEL
from tests.api.invalid_cases import check_error

CAP = 4


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": ["a"] * (CAP + 1)}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2]] * (CAP + 1)}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 3, "temperature": 1.0}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"], "best_of": 3, "temperature": 1.0}, "best_of"),
        ("/v1/completions", {"prompt": ["a"] * CAP, "n": 2, "temperature": 1.0}, "n"),
        ("/v1/chat/completions", {"messages": HI, "n": CAP + 1, "temperature": 1.0}, "n"),
        ("/v1/chat/completions", {"messages": HI, "n": 2, "best_of": CAP + 1, "temperature": 1.0}, "best_of"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_more_sequences_than_the_cap_is_400_and_nothing_starts(make_client, path, body, param, stream):
    client = make_client(max_seqs_per_request=CAP)
    if stream and "best_of" in body:
        body = {**body, "n": body["best_of"], "best_of": None}  # best_of must equal n in a stream
        param = "n"
    response = client.post(path, json={"model": MODEL, "max_tokens": 3, "stream": stream, **body})
    error = check_error(response, 400, param)
    assert f"at most {CAP} are allowed per request" in error["message"]
    assert client.engine.num_added == 0


def test_exactly_the_cap_is_served(make_client):
    client = make_client(max_seqs_per_request=CAP)
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "temperature": 1.0, "max_tokens": 3}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == CAP and client.engine.num_added == CAP


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_queue_refuses_the_whole_request(client, stream):
    client.engine.is_queue_full = True
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 3, "stream": stream}
    response = client.post("/v1/completions", json=body)
    error = check_error(response, 429, None)
    assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"
    assert client.engine.num_added == 0
    client.engine.is_queue_full = False
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.engine.num_added == 3


def test_a_request_arriving_while_draining_is_503(client):
    async def begin() -> None:
        client.app.state.frontend.drain.begin(30.0)

    client.loop.run_until_complete(begin())
    body = {"model": MODEL, "messages": HI}
    for response in (client.post("/v1/chat/completions", json=body), client.get("/health")):
        error = check_error(response, 503, None)
        assert error["code"] == "shutting_down" and error["type"] == "server_error"
        assert response.headers["connection"] == "close"
    assert client.engine.num_added == 0


def _server_config(argv: list[str]):
    return server_config(merged_options(build_parser().parse_args(["serve", *argv])), "m")


def test_the_cap_and_the_grace_period_from_flags_and_the_config_file(tmp_path):
    default = _server_config([])
    assert (default.max_seqs_per_request, default.shutdown_grace_seconds) == (256, 20.0)
    assert _server_config(["--max-queue-len", "10"]).max_seqs_per_request == 10  # the default shrinks to fit
    flags = _server_config(["--max-seqs-per-request", "3", "--shutdown-grace-seconds", "2.5"])
    assert (flags.max_seqs_per_request, flags.shutdown_grace_seconds) == (3, 2.5)
    with pytest.raises(ValueError, match=r"max_seqs_per_request \(20\) is more than max_queue_len \(10\)"):
        _server_config(["--max-queue-len", "10", "--max-seqs-per-request", "20"])
    with pytest.raises(ValueError, match="max_seqs_per_request must be positive"):
        _server_config(["--max-seqs-per-request", "0"])
    with pytest.raises(ValueError, match="shutdown_grace_seconds must be >= 0"):
        _server_config(["--shutdown-grace-seconds", "-1"])
    path = tmp_path / "config.json"
    schedule = {"maxQueueLen": 64, "maxSeqsPerRequest": 32}
    path.write_text(
        json.dumps(
            {"ServerConfig": {"shutdownGraceSeconds": 7}, "BackendConfig": {"ScheduleConfig": schedule}}
        )
    )
    configured = _server_config(["--config", str(path)])
    assert (configured.max_seqs_per_request, configured.shutdown_grace_seconds) == (32, 7)
    overridden = _server_config(["--config", str(path), "--shutdown-grace-seconds", "0"])
    assert overridden.shutdown_grace_seconds == 0
