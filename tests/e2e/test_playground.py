"""The web playground in a real headless Chromium (Debian's chromium, driven by Playwright) against a real
server with an API key: the page asks for the key (a bad one shows the server's error), streamed text
arrives and grows and equals the server's greedy answer, the timing strip shows the MindIE fields, Stop
aborts the request on the server, a forced tool call and a JSON-schema answer are rendered, reasoning is
folded. Screenshots go to test-artifacts/playground/ (gitignored; CI can keep them).

Skipped, with the reason, where chromium or playwright is missing; CI installs both (.ci/run, the test
extras).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import KEYED_API_KEY
from tests.e2e.helpers import metric, wait_until_idle

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
ARTIFACTS = pathlib.Path(__file__).resolve().parents[2] / "test-artifacts" / "playground"
AUTH = {"Authorization": f"Bearer {KEYED_API_KEY}"}
QUESTION = "What is the capital of France?"
# An answer that runs to max_tokens: an 8-token answer can reach the page in one or two network reads, and
# then there is nothing to see grow.
LONG_QUESTION = "Tell me a story about a cat."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
# NOTE: page scripts are passed as functions: the page's Content-Security-Policy refuses eval, which
# Playwright uses for a bare expression.
LAST_CONTENT = "([...document.querySelectorAll('[data-testid=content]')].at(-1)?.textContent ?? '')"


def missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (it is in the test extras: pip install -e '.[test]')"
    if not os.path.exists(CHROMIUM):
        return f"no {CHROMIUM} (Debian: apt-get install chromium; .ci/run installs it)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    reason = missing()
    if reason is not None:
        print(f"skipping the browser tests: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS,
        )  # fmt: skip
        yield context
        context.close()


@pytest.fixture
def page(browser, keyed_server, request):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(keyed_server.base_url + "/")
    yield page
    shot(page, request.node.name)
    page.close()
    assert errors == [], errors  # no script error anywhere in the test


@pytest.fixture(scope="module")
def client(keyed_server):
    return OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEYED_API_KEY, max_retries=0, timeout=120)


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def unlock(page, key: str = KEYED_API_KEY) -> None:
    page.wait_for_selector("[data-testid=key-dialog][open]")
    page.fill("[data-testid=key-input]", key)
    page.click("[data-testid=key-submit]")


def send(page, text: str) -> None:
    page.fill("[data-testid=prompt]", text)
    page.press("[data-testid=prompt]", "Enter")


def settings(page, **fields: str) -> None:
    unlock(page)
    page.wait_for_function("() => document.querySelector('#model').options.length > 0")
    if "extra" in fields:
        page.click("summary:has-text('Extra request fields')")  # unfold it
    for name, value in fields.items():
        page.fill(f"#{name}", value)


def test_the_page_is_open_and_nothing_else(keyed_server):
    page = httpx.get(keyed_server.base_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for asset in ("playground.js", "stream.js", "playground.css"):
        assert httpx.get(f"{keyed_server.base_url}/playground/{asset}", timeout=10).status_code == 200
    for path in ("/v1/models", "/metrics", "/playground/", "/playground/index.html", "/version"):
        assert httpx.get(keyed_server.base_url + path, timeout=10).status_code == 401, path


def test_a_bad_key_shows_the_error_and_the_right_one_opens(page):
    unlock(page, "not-the-key")
    page.wait_for_function("() => document.querySelector('[data-testid=key-error]').textContent.length > 0")
    assert page.text_content("[data-testid=key-error]") == "invalid API key"
    assert page.is_visible("[data-testid=key-dialog]")
    shot(page, "bad-key-error")
    unlock(page)
    page.wait_for_function("() => document.querySelector('#model').options.length > 0")
    assert not page.is_visible("[data-testid=key-dialog]")


def test_streamed_text_grows_and_equals_the_greedy_answer(page, keyed_server, client):
    settings(page, temperature="0", max_tokens="48")
    # Every length the answer's text had, as the page drew it.
    page.evaluate(
        "() => { window.lengths = []; new MutationObserver(() => window.lengths.push("
        + LAST_CONTENT
        + ".length))"
        ".observe(document.querySelector('[data-testid=messages]'),"
        " {subtree: true, childList: true, characterData: true}); }"
    )
    send(page, LONG_QUESTION)
    page.wait_for_selector("[data-testid=timing]", timeout=120_000)
    expected = client.chat.completions.create(
        model=keyed_server.model,
        messages=[{"role": "user", "content": LONG_QUESTION}],
        temperature=0,
        max_tokens=48,
    )
    text = page.evaluate(f"() => {LAST_CONTENT}")
    assert text == expected.choices[0].message.content
    lengths = [n for n in page.evaluate("() => window.lengths") if n > 0]
    assert lengths == sorted(lengths) and len(set(lengths)) >= 3, lengths  # it grew, piece by piece
    timing = {field: page.text_content(f"[data-testid=timing] [data-field={field}]")
              for field in ("ttft", "prefill", "tokens", "speed", "cached")}  # fmt: skip
    assert timing["tokens"] == f"{expected.usage.completion_tokens} tokens"
    assert timing["ttft"].startswith("TTFT ") and timing["speed"].endswith(" tokens/s")
    assert timing["cached"].endswith(" cached prompt tokens")
    points = page.get_attribute("[data-testid=timing] svg polyline", "points").split()
    assert len(points) == expected.usage.completion_tokens - 1  # one decode step per token after the first


def test_stop_aborts_the_request_on_the_server(page, keyed_server):
    wait_until_idle(keyed_server.base_url, AUTH)
    settings(page, max_tokens="2000", extra='{"ignore_eos": true}')
    model = f'model_name="{keyed_server.model}"'
    aborted = f'vllm:request_success_total{{finished_reason="abort",{model}}}'
    before = metric(keyed_server.base_url, aborted, AUTH)
    send(page, "Tell me a long story about a dragon.")
    page.wait_for_function(f"() => {LAST_CONTENT}.length > 40", timeout=120_000)
    assert metric(keyed_server.base_url, f"vllm:num_requests_running{{{model}}}", AUTH) == 1
    page.click("[data-testid=stop]")
    page.wait_for_selector("[data-testid=stopped]")
    shown = page.evaluate(f"() => {LAST_CONTENT}")
    wait_until_idle(keyed_server.base_url, AUTH, timeout=10)  # nothing runs, every KV block free
    assert metric(keyed_server.base_url, aborted, AUTH) == before + 1
    # Read when the page said "stopped", compared once the server has ended the request: a page that went
    # on reading the stream would have shown what the server sent in between.
    assert page.evaluate(f"() => {LAST_CONTENT}") == shown  # the text stopped too
    assert page.is_enabled("[data-testid=send]") and not page.is_enabled("[data-testid=stop]")


def test_a_forced_tool_call_is_rendered(page, keyed_server, client):
    settings(page, temperature="0", max_tokens="128")
    page.fill("[data-testid=tools]", json.dumps([WEATHER_TOOL]))
    page.select_option("[data-testid=tool-choice]", "function:get_weather")
    send(page, "What is the weather in Paris?")
    page.wait_for_selector("[data-testid=timing]", timeout=120_000)
    expected = client.chat.completions.create(
        model=keyed_server.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=128,
    )  # fmt: skip
    [call] = expected.choices[0].message.tool_calls
    assert page.text_content("[data-testid=tool-call] .tool-name") == "get_weather" == call.function.name
    shown = json.loads(page.text_content("[data-testid=tool-call] .tool-arguments"))
    assert shown == json.loads(call.function.arguments) and isinstance(shown["city"], str)


def test_json_schema_mode(page, keyed_server, client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    settings(page, temperature="0", max_tokens="32")
    page.select_option("[data-testid=format]", "json_schema")
    page.fill("[data-testid=schema]", json.dumps(schema))
    send(page, "What is 2 + 3?")
    page.wait_for_selector("[data-testid=timing]", timeout=120_000)
    expected = client.chat.completions.create(
        model=keyed_server.model, messages=[{"role": "user", "content": "What is 2 + 3?"}], temperature=0,
        max_tokens=32, response_format={"type": "json_schema", "json_schema": {"name": "playground", "schema": schema}},
    )  # fmt: skip
    text = page.evaluate(f"() => {LAST_CONTENT}")
    assert text == expected.choices[0].message.content
    if expected.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text)["answer"], int)


def test_reasoning_is_folded(page, keyed_server, client):
    settings(page, temperature="0", max_tokens="40",
             extra='{"chat_template_kwargs": {"enable_thinking": true}, "thinking_budget": 4}')  # fmt: skip
    send(page, QUESTION)
    page.wait_for_selector("[data-testid=timing]", timeout=120_000)
    expected = client.chat.completions.create(
        model=keyed_server.model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget": 4},
    )  # fmt: skip
    reasoning = expected.choices[0].message.model_extra["reasoning_content"]
    assert reasoning
    folded = page.locator("[data-testid=reasoning]")
    assert folded.is_visible() and folded.get_attribute("open") is None  # shown, folded
    assert folded.locator("pre").text_content() == reasoning
    assert expected.choices[0].message.content  # the answer after the forced </think>
    assert page.evaluate(f"() => {LAST_CONTENT}") == expected.choices[0].message.content
