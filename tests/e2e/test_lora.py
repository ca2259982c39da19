"""A real `serval serve` of the tiny llama with LoRA adapters, driven by the `openai` client: an adapter
declared with --lora-modules, another loaded and unloaded at run time by an admin (only from under
--lora-root, and no answer names a server path), greedy outputs equal to transformers + peft, and every KV
block free at the end."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest
import torch

from tests.api.invalid_cases import check_error
from tests.e2e.conftest import running_server
from tests.e2e.helpers import sse_chunks, wait_until_idle

BASE = "tiny"
USER_KEY, ADMIN_KEY = "user-key", "admin-key"
PROMPT = [5, 40, 41, 42, 300, 301, 17, 99]
MAX_TOKENS = 8


def auth(key: str = USER_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory, tiny_lora_factory) -> str:
    """The server's --lora-root: a copy of the "partial" adapter, and a directory that is not an adapter."""
    root = tmp_path_factory.mktemp("lora-root")
    shutil.copytree(tiny_lora_factory("partial")[0], root / "partial")
    (root / "not-an-adapter").mkdir()
    (root / "not-an-adapter" / "adapter_config.json").write_text('{"r": "eight"}')
    return str(root)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, tiny_model_factory, tiny_lora_factory, lora_root):
    directory, _ = tiny_model_factory("llama", False)
    full_path, _ = tiny_lora_factory("full")
    log_path = tmp_path_factory.mktemp("lora-server") / "server.log"
    args = ["--model", directory, "--served-model-name", BASE, "--dtype", "float32", "--lora-modules",
            f"full={full_path}", "--max-loras", "2", "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY,
            "--lora-root", lora_root, "--num-kv-blocks", "64", "--log-level", "warning"]  # fmt: skip
    with running_server(args, log_path) as server:
        yield server


@pytest.fixture(scope="module")
def client(lora_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{lora_server.base_url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def expected_text(model, directory: str) -> str:
    """The reference's greedy continuation of PROMPT, decoded as the server decodes it."""
    from tokenizers import Tokenizer

    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
    tokenizer = Tokenizer.from_file(f"{directory}/tokenizer.json")
    return tokenizer.decode(out[0, len(PROMPT) :].tolist(), skip_special_tokens=True)


def complete(client, model: str) -> str:
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return response.choices[0].text


def load(server, name: str, path: str, key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": path},
        headers=auth(key),
    )


def unload(server, name: str, key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth(key)
    )


def test_models_lists_the_adapter_with_its_parent(lora_server, client, tiny_lora_factory):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [BASE, "full"]
    assert models["full"].parent == BASE and models["full"].root == "full"  # its name, not its path
    listing = httpx.get(f"{lora_server.base_url}/v1/models", headers=auth()).text
    assert (
        tiny_lora_factory("full")[0] not in listing
        and os.path.dirname(tiny_lora_factory("full")[0]) not in listing
    )


def test_outputs_match_peft_for_base_and_adapter(client, tiny_model_factory, tiny_lora_factory):
    directory, base = tiny_model_factory("llama", False)
    _, peft_model = tiny_lora_factory("full")
    adapter_text, base_text = complete(client, "full"), complete(client, BASE)
    assert adapter_text == expected_text(peft_model, directory)
    assert base_text == expected_text(base, directory)
    assert adapter_text != base_text


def test_chat_and_stream_with_the_adapter(lora_server, client):
    messages = [{"role": "user", "content": "hello world"}]
    response = client.chat.completions.create(model="full", messages=messages, max_tokens=4, temperature=0)
    assert response.model == "full" and response.usage.completion_tokens >= 1
    body = {"model": "full", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    chunks = sse_chunks(lora_server.base_url, "/v1/chat/completions", body, headers=auth())
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == response.choices[0].message.content
    assert {c["model"] for c in chunks} == {"full"}


def test_load_and_unload_at_run_time(lora_server, client, tiny_lora_factory, tiny_model_factory, lora_root):
    from openai import NotFoundError

    directory, _ = tiny_model_factory("llama", False)
    _, peft_model = tiny_lora_factory("partial")
    path = "partial"  # relative to --lora-root
    assert (
        check_error(load(lora_server, "partial", path, key=USER_KEY), 403, None)["code"]
        == "admin_key_required"
    )
    assert load(lora_server, "partial", path, key="nope").status_code == 401
    error = check_error(load(lora_server, "bad", "not-an-adapter"), 400, None)  # r is not a number
    assert "not-an-adapter" in error["message"] and lora_root not in error["message"]
    assert load(lora_server, "partial", path).status_code == 200
    assert complete(client, "partial") == expected_text(peft_model, directory)
    models = {m.id: m for m in client.models.list().data}
    assert models["partial"].root == "partial" and lora_root not in str(models["partial"].model_dump())
    check_error(load(lora_server, "partial", path), 400, None)  # the name is taken
    check_error(load(lora_server, "third", path), 409, None)  # both slots are taken
    assert unload(lora_server, "partial", key=USER_KEY).status_code == 403
    assert unload(lora_server, "partial").status_code == 200
    with pytest.raises(NotFoundError):
        complete(client, "partial")
    check_error(unload(lora_server, "partial"), 404, "lora_name")
    assert "partial" not in [m.id for m in client.models.list().data]


def test_loads_from_outside_the_root_are_refused(lora_server, client, tiny_lora_factory, lora_root):
    adapter = tiny_lora_factory("partial")[0]  # a real adapter, but outside the root
    os.symlink(adapter, os.path.join(lora_root, "escape"))
    os.mkdir(os.path.join(lora_root, "linked-file"))
    shutil.copy(os.path.join(adapter, "adapter_config.json"), os.path.join(lora_root, "linked-file"))
    os.symlink(
        os.path.join(adapter, "adapter_model.safetensors"),
        os.path.join(lora_root, "linked-file", "adapter_model.safetensors"),
    )
    for path in (
        adapter,  # absolute, outside
        "escape",  # a symlink under the root to a directory outside it
        os.path.relpath(adapter, lora_root),  # ../lora-llama-partial0
        f"{lora_root}/../{os.path.basename(adapter)}",
        "linked-file",  # inside, but its weights file links out
    ):
        response = load(lora_server, "outside", path)
        error = check_error(response, 400, "lora_path")
        assert "outside the LoRA root" in error["message"], path
        assert lora_root not in response.text and adapter not in response.text
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "outside" not in [m.id for m in client.models.list().data]


def test_unknown_adapter_is_404_and_every_block_is_free_after(lora_server, client):
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as caught:
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert caught.value.body["code"] == "model_not_found"
    wait_until_idle(lora_server.base_url, headers=auth())


def test_a_bad_startup_adapter_stops_the_server_with_one_line(tiny_model_factory, tmp_path):
    import subprocess
    import sys

    directory, _ = tiny_model_factory("llama", False)
    command = [sys.executable, "-m", "serval.entrypoints.cli", "serve", "--port", "1", "--model", directory, "--dtype",
               "float32", "--lora-modules", f"bad={tmp_path}"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "cannot load the LoRA adapter 'bad'" in result.stderr and "Traceback" not in result.stderr
