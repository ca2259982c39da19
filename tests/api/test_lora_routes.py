"""The LoRA routes in-process over the scripted engine: model selection, /v1/models, load/unload bodies and
errors (a table of 4xx cases), loads only from under --lora-root, and who may call the admin routes.
tests/e2e/test_lora.py runs the real model."""

from __future__ import annotations

import os

import pytest

from tests.api.conftest import MODEL
from tests.api.invalid_cases import check_error

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture
def lora_root(tmp_path) -> str:
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    return str(tmp_path / "adapters")


@pytest.fixture
def adapter_dir(lora_root) -> str:
    return os.path.join(lora_root, "sql")


@pytest.fixture
def client(make_client, lora_root):
    return make_client(lora_root=lora_root)


def test_model_names_an_adapter_or_the_base_model(client, adapter_dir):
    response = client.post(LOAD, json={"lora_name": "sql", "lora_path": adapter_dir})
    assert response.status_code == 200, response.text
    assert "sql" in response.text
    data = client.post("/v1/chat/completions", json=chat("sql")).json()
    assert data["model"] == "sql"
    data = client.post("/v1/completions", json={"model": "sql", "prompt": "A", "max_tokens": 2}).json()
    assert data["model"] == "sql"
    client.post("/v1/chat/completions", json=chat(MODEL))
    assert list(client.engine.lora_names.values()) == ["sql", "sql", None]
    assert client.post("/tokenize", json={"model": "sql", "prompt": "x"}).status_code == 200
    check_error(client.post("/v1/chat/completions", json=chat("nope")), 404, "model")


def test_models_lists_adapters_with_their_parent(client, adapter_dir):
    client.post(LOAD, json={"lora_name": "b", "lora_path": adapter_dir})
    client.post(LOAD, json={"lora_name": "a", "lora_path": adapter_dir, "base_model_name": "declared"})
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert list(cards) == [MODEL, "a", "b"]
    assert cards[MODEL]["parent"] is None
    assert cards["b"]["parent"] == MODEL and cards["b"]["root"] == "b"  # its name: never a server path
    assert cards["a"]["parent"] == "declared"
    assert client.get("/v1/models/b").json() == cards["b"]
    assert client.post(UNLOAD, json={"lora_name": "b"}).status_code == 200
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [MODEL, "a"]
    check_error(client.get("/v1/models/b"), 404, "model")
    check_error(client.post("/v1/chat/completions", json=chat("b")), 404, "model")


# (body, status, param): what a bad load or unload gets
BAD_LOADS = [
    ({}, 400, "lora_name"),
    ({"lora_name": "x"}, 400, "lora_path"),
    ({"lora_name": "", "lora_path": "sql"}, 400, "lora_name"),
    ({"lora_name": "x", "lora_path": 3}, 400, "lora_path"),
    ({"lora_name": MODEL, "lora_path": "sql"}, 400, "lora_name"),  # the base model's name
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),  # outside the root
    ({"lora_name": "x", "lora_path": "/tmp"}, 400, "lora_path"),  # a parent of the root
    ({"lora_name": "x", "lora_path": "../.."}, 400, "lora_path"),
    ({"lora_name": "x", "lora_path": "missing"}, 400, "lora_path"),  # under the root, but not there
    ({"lora_name": "x", "lora_path": "sql\u0000"}, 400, "lora_path"),
    ({"lora_name": "taken", "lora_path": "sql"}, 400, None),  # already loaded
]
BAD_UNLOADS = [({}, 400, "lora_name"), ({"lora_name": "unknown"}, 404, "lora_name")]


@pytest.mark.parametrize(("payload", "status", "param"), BAD_LOADS)
def test_bad_loads(client, lora_root, adapter_dir, payload, status, param):
    assert client.post(LOAD, json={"lora_name": "taken", "lora_path": adapter_dir}).status_code == 200
    response = client.post(LOAD, json=payload)
    check_error(response, status, param)
    assert lora_root not in response.text and os.path.dirname(lora_root) not in response.text


def test_adapters_load_by_a_path_relative_to_the_root_or_absolute_inside_it(client, lora_root, adapter_dir):
    assert client.post(LOAD, json={"lora_name": "rel", "lora_path": "sql"}).status_code == 200
    assert (
        client.post(LOAD, json={"lora_name": "abs", "lora_path": f"{lora_root}/x/../sql"}).status_code == 200
    )
    assert {card.path for card in client.engine.loras.values()} == {os.path.realpath(adapter_dir)}


def test_a_symlink_out_of_the_root_is_refused(client, lora_root, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", os.path.join(lora_root, "escape"))
    error = check_error(client.post(LOAD, json={"lora_name": "x", "lora_path": "escape"}), 400, "lora_path")
    assert "outside the LoRA root" in error["message"] and str(tmp_path) not in error["message"]
    # A file inside an adapter directory that links out is refused too: it would be read from outside.
    (tmp_path / "secret").write_text("{}")
    os.symlink(tmp_path / "secret", os.path.join(lora_root, "sql", "adapter_config.json"))
    check_error(client.post(LOAD, json={"lora_name": "x", "lora_path": "sql"}), 400, "lora_path")


def test_without_a_root_nothing_loads_at_run_time(make_client, adapter_dir):
    client = make_client()
    error = check_error(
        client.post(LOAD, json={"lora_name": "x", "lora_path": adapter_dir}), 400, "lora_path"
    )
    assert "--lora-root" in error["message"] and adapter_dir not in error["message"]
    assert client.engine.loras == {}


@pytest.mark.parametrize(("payload", "status", "param"), BAD_UNLOADS)
def test_bad_unloads(client, payload, status, param):
    check_error(client.post(UNLOAD, json=payload), status, param)


def test_no_free_slot_is_a_conflict(client, adapter_dir):
    for name in ("a", "b"):  # the fake engine has two slots
        assert client.post(LOAD, json={"lora_name": name, "lora_path": adapter_dir}).status_code == 200
    error = check_error(client.post(LOAD, json={"lora_name": "c", "lora_path": adapter_dir}), 409, None)
    assert error["code"] == "conflict"


def test_bad_json_body(client):
    check_error(client.post(LOAD, content=b"{", headers={"content-type": "application/json"}), 400, None)


# (API keys, admin keys, the bearer presented, status of an admin route, of an ordinary route)
AUTH_CASES = [
    ((), (), None, 200, 200),  # no keys at all: everything is open
    (("user",), (), None, 401, 401),
    (("user",), (), "user", 403, 200),  # API keys but no admin key: nobody is admin
    (("user",), ("admin",), "user", 403, 200),
    (("user",), ("admin",), "admin", 200, 200),  # an admin key is an API key too
    (("user",), ("admin",), "wrong", 401, 401),
    ((), ("admin",), None, 401, 200),  # admin keys alone guard the admin routes only
    ((), ("admin",), "admin", 200, 200),
]


@pytest.mark.parametrize(("api_keys", "admin_keys", "bearer", "admin_status", "user_status"), AUTH_CASES)
def test_admin_routes_need_an_admin_key(
    make_client, lora_root, adapter_dir, api_keys, admin_keys, bearer, admin_status, user_status
):
    client = make_client(api_keys=api_keys, admin_api_keys=admin_keys, lora_root=lora_root)
    headers = {} if bearer is None else {"Authorization": f"Bearer {bearer}"}
    response = client.post(LOAD, headers=headers, json={"lora_name": "a", "lora_path": adapter_dir})
    assert response.status_code == admin_status, response.text
    if admin_status != 200:
        error = check_error(response, admin_status, None)
        assert error["type"] == {401: "authentication_error", 403: "permission_error"}[admin_status]
    assert client.post(UNLOAD, headers=headers, json={"lora_name": "a"}).status_code == admin_status
    assert client.get("/v1/models", headers=headers).status_code == user_status
    assert client.get("/health").status_code == 200
