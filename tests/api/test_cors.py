"""CORS over the real app (scripted engine): off by default, preflights and simple requests from allowed and
refused origins, credentials never with the wildcard origin, and the options as the CLI and a config file
spell them."""

from __future__ import annotations

import json

import pytest

from serval.entrypoints.cli import build_parser, merged_options
from serval.server_config import CorsConfig, cors_config

ALLOWED = "https://app.example"
OTHER = "https://evil.example"
CHAT = "/v1/chat/completions"


def preflight(client, origin: str, method: str = "POST", headers: str | None = "content-type, authorization"):
    request_headers = {"origin": origin, "access-control-request-method": method}
    if headers is not None:
        request_headers["access-control-request-headers"] = headers
    return client.request("OPTIONS", CHAT, headers=request_headers)


def chat_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def assert_error_shape(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_off_by_default_a_preflight_is_a_clean_405(make_client):
    client = make_client()
    response = preflight(client, ALLOWED)
    error = assert_error_shape(response, 405)
    assert error["type"] == "invalid_request_error"
    assert not any(name.startswith("access-control-") for name in response.headers)
    simple = client.post(CHAT, json=chat_body("fake-model"), headers={"origin": ALLOWED})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_off_by_default_with_keys_a_preflight_is_a_401(make_client):
    response = preflight(make_client(api_keys=("key",)), ALLOWED)
    assert assert_error_shape(response, 401)["code"] == "invalid_api_key"


def test_preflight_from_an_allowed_origin(make_client):
    client = make_client(api_keys=("key",), cors=CorsConfig((ALLOWED,), allow_credentials=True))
    response = preflight(client, ALLOWED)  # no key: a browser never sends one on a preflight
    assert response.status_code == 204, response.text
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert response.headers["access-control-allow-credentials"] == "true"
    assert response.headers["access-control-allow-methods"] == "POST"
    assert response.headers["access-control-allow-headers"] == "content-type, authorization"
    assert int(response.headers["access-control-max-age"]) > 0
    assert "Origin" in response.headers["vary"]


@pytest.mark.parametrize(
    ("cors", "origin", "method", "headers", "named"),
    [
        (CorsConfig((ALLOWED,)), OTHER, "POST", None, "origin"),
        (CorsConfig((ALLOWED,)), ALLOWED + "/", "POST", None, "origin"),  # an origin has no path
        (CorsConfig((ALLOWED,)), "null", "POST", None, "origin"),
        (CorsConfig((ALLOWED,), allowed_methods=("GET", "POST")), ALLOWED, "DELETE", None, "method"),
        (CorsConfig((ALLOWED,), allowed_headers=("authorization",)), ALLOWED, "POST", "x-secret", "header"),
    ],
)
def test_preflight_refused(make_client, cors, origin, method, headers, named):
    response = preflight(make_client(cors=cors), origin, method, headers)
    error = assert_error_shape(response, 403)
    assert error["code"] == "cors_not_allowed" and f"the {named} " in error["message"]
    assert not any(name.startswith("access-control-") for name in response.headers)


def test_listed_methods_and_headers(make_client):
    cors = CorsConfig((ALLOWED,), allowed_methods=("POST",), allowed_headers=("Authorization",))
    response = preflight(make_client(cors=cors), ALLOWED, "post", "Content-Type, Authorization")
    assert response.status_code == 204
    assert response.headers["access-control-allow-methods"] == "POST"
    # Content-Type is a safelisted name: allowed without being listed.
    assert response.headers["access-control-allow-headers"] == "content-type, authorization"


def test_simple_requests_get_the_grant_only_for_allowed_origins(make_client):
    client = make_client(api_keys=("key",), cors=CorsConfig((ALLOWED,), allow_credentials=True))
    auth = {"authorization": "Bearer key"}
    allowed = client.post(CHAT, json=chat_body("fake-model"), headers={"origin": ALLOWED, **auth})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    assert allowed.headers["access-control-allow-credentials"] == "true"
    streamed = client.post(
        CHAT, json={**chat_body("fake-model"), "stream": True}, headers={"origin": ALLOWED, **auth}
    )
    assert streamed.headers["access-control-allow-origin"] == ALLOWED
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # A 401 carries the grant too, so the page can read why.
    refused = client.get("/v1/models", headers={"origin": ALLOWED, "authorization": "Bearer wrong"})
    assert assert_error_shape(refused, 401) and refused.headers["access-control-allow-origin"] == ALLOWED
    # Another origin is answered (CORS protects the reading, not the server) but without a grant.
    other = client.get("/v1/models", headers={"origin": OTHER, **auth})
    assert other.status_code == 200
    assert not any(name.startswith("access-control-") for name in other.headers)


def test_any_origin_without_credentials_is_answered_with_a_star(make_client):
    client = make_client(cors=CorsConfig(("*",)))
    response = preflight(client, OTHER)
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in response.headers
    simple = client.get("/v1/models", headers={"origin": OTHER})
    assert simple.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in simple.headers


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allowed_origins": ("*",), "allow_credentials": True}, "any web site"),
        ({"allowed_origins": ()}, "at least one origin"),
        ({"allowed_origins": ("https://app.example/",)}, "not an origin"),
        ({"allowed_origins": ("app.example",)}, "not an origin"),
        ({"allowed_origins": ("*", ALLOWED)}, "give it alone"),
        ({"allowed_origins": (ALLOWED,), "allowed_headers": ("a, b",)}, "allowed_headers"),
    ],
)
def test_bad_cors_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CorsConfig(**kwargs)


def _cors_from(argv: list[str]) -> CorsConfig | None:
    return cors_config(merged_options(build_parser().parse_args(["serve", *argv])))


def test_flags_as_vllm_spells_them():
    cors = _cors_from(
        ["--allowed-origins", json.dumps([ALLOWED, "http://localhost:3000"]), "--allowed-methods", '["GET", "POST"]',
         "--allowed-headers", '["authorization"]', "--allow-credentials"]
    )  # fmt: skip
    assert cors == CorsConfig((ALLOWED, "http://localhost:3000"), ("GET", "POST"), ("authorization",), True)
    assert _cors_from([]) is None
    with pytest.raises(ValueError, match="needs --allowed-origins"):
        _cors_from(["--allow-credentials"])
    with pytest.raises(ValueError, match="any web site"):
        _cors_from(["--allowed-origins", '["*"]', "--allow-credentials"])


def test_a_flag_that_is_not_a_json_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--allowed-origins", ALLOWED])
    assert exit_info.value.code == 2
    assert "expected a JSON list of strings" in capsys.readouterr().err


def test_config_file_keys(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"ServerConfig": {"allowedOrigins": [ALLOWED], "allowedMethods": ["POST"],
                                                 "allowedHeaders": ["authorization"], "allowCredentials": True}}))  # fmt: skip
    assert _cors_from(["--config", str(path)]) == CorsConfig((ALLOWED,), ("POST",), ("authorization",), True)
    # Flags win over the file.
    assert _cors_from(["--config", str(path), "--no-allow-credentials"]).allow_credentials is False
    path.write_text(json.dumps({"ServerConfig": {"allowedOrigins": ALLOWED}}))
    with pytest.raises(ValueError, match="allowedOrigins must be a list of strings"):
        _cors_from(["--config", str(path)])
