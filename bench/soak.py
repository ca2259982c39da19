"""Soak test: a serval server under mixed load for minutes, watched for errors, memory growth and KV leaks.

Owns the request mix, the outcome counts and the pass/fail verdict. It starts a server itself (the default
model on a free loopback port, stopped by process id at the end; bench/compare.py's helpers) or uses `--url`
of a running one (then memory is read only if `--pid` is given). For `--minutes` it keeps `--concurrency`
requests in flight, drawn from: streamed and non-streamed chat completions, streams the client closes after
a random number of chunks, tool calls (`tool_choice` auto or required), structured output (`response_format`
json_schema) and now and then a /v1/completions request.

Every `--interval` seconds one JSON line on stdout: the server's resident memory (VmRSS, and VmRSS less the
KV-cache mapping, which fills lazily: see `memory_mib`), requests by outcome, errors by kind, and the /metrics
gauges (running, waiting, KV-cache usage). After the load stops and the server settles, one summary line:
memory after the first `--warmup-minutes` vs at the end, errors by kind, and whether running/waiting are 0
and KV-cache usage is back at its value before the load. A progress bar of finished requests goes to stderr.

    TORCH_EXTENSIONS_DIR=/tmp/ext_dev .venv/bin/python bench/soak.py --minutes 3 --concurrency 16
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 --pid "$(pgrep -f 'serval serve')"

Exit status 1 when any error was counted (a 5xx status or in-band server_error, a 4xx other than 429, a
broken connection, or a body that breaks its contract: a required tool call missing, a schema answer that is
not JSON), when memory other than the KV cache grew by more than `--max-rss-growth` from warm-up to the end,
or when the KV cache did not return to its baseline. A 429 is back-pressure: an outcome, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

import httpx
from compare import free_port, start, stop
from serve import make_prompt
from tqdm import tqdm

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"]}}},
]  # fmt: skip
PERSON_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age"],
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
}  # fmt: skip
# Request kinds and their weights in the mix.
KINDS = {"chat": 3, "chat_stream": 4, "disconnect": 2, "tools": 2, "json_schema": 2, "completion": 1}
GAUGES = {
    "running": "serval_num_requests_running",
    "waiting": "serval_num_requests_waiting",
    "kv_cache_usage": "serval_kv_cache_usage_perc",
}


class Soak:
    def __init__(self, args, client: httpx.AsyncClient, bar: tqdm) -> None:
        self.args = args
        self.client = client
        self.bar = bar
        self.outcomes: Counter[str] = Counter()  # "<kind> <outcome>", outcome ok/disconnected/429/error
        self.errors: Counter[str] = Counter()  # error kind -> count
        self.first_errors: dict[str, str] = {}  # error kind -> the first such error's detail

    def record(self, kind: str, error: str | None, detail: str = "", outcome: str = "ok") -> None:
        if error is not None:
            outcome = "error"
            self.errors[error] += 1
            self.first_errors.setdefault(error, f"{kind}: {detail}"[:300])
        self.outcomes[f"{kind} {outcome}"] += 1
        self.bar.update(1)

    def body(self, kind: str, rng: random.Random) -> tuple[str, dict, bool]:
        """The route, the JSON body, and whether it streams."""
        prompt = make_prompt(rng, rng.randint(10, 80))
        common = {"model": self.args.model, "max_tokens": rng.randint(8, self.args.max_tokens)}
        common["temperature"] = rng.choice([0.0, 0.7])
        stream = kind in ("chat_stream", "disconnect") or (
            kind in ("tools", "completion") and rng.random() < 0.5
        )
        if stream:
            common["stream"] = True
            common["stream_options"] = {"include_usage": rng.random() < 0.5}
        if kind == "completion":
            return "/v1/completions", {**common, "prompt": prompt}, stream
        body = {**common, "messages": [{"role": "user", "content": prompt}]}
        if kind == "tools":
            city = rng.choice(["Paris", "Lima", "Oslo", "Kyoto", "Accra"])
            body["messages"] = [{"role": "user", "content": f"What is the weather and time in {city}?"}]
            body.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required"]))
        elif kind == "json_schema":
            body["messages"] = [{"role": "user", "content": "Describe a person as JSON. " + prompt}]
            body["max_tokens"] = self.args.max_tokens
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
            }
        return "/v1/chat/completions", body, stream

    async def one_request(self, rng: random.Random) -> None:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        path, body, stream = self.body(kind, rng)
        try:
            if stream:
                await self.streamed(kind, path, body, rng)
            else:
                response = await self.client.post(path, json=body)
                if self.check_status(kind, response.status_code, response.text):
                    choice = response.json()["choices"][0]
                    message = choice.get("message") or {}
                    self.check_answer(kind, body, choice["finish_reason"], message.get("content"),
                                      message.get("tool_calls") or [])  # fmt: skip
        except httpx.HTTPError as e:
            self.record(kind, f"transport {type(e).__name__}", repr(e))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            self.record(kind, "bad body", repr(e))

    def check_status(self, kind: str, status: int, text: str) -> bool:
        """Records a failed status; True when the answer is a 200 to read on."""
        if status == 200:
            return True
        if status == 429:
            self.record(kind, None, outcome="429")
        else:
            self.record(kind, f"http {status}", text[:200])
        return False

    async def streamed(self, kind: str, path: str, body: dict, rng: random.Random) -> None:
        cut_after = rng.randint(1, max(1, body["max_tokens"] // 2)) if kind == "disconnect" else None
        num_chunks, finish_reason, content, tool_calls = 0, None, [], {}
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                self.check_status(kind, response.status_code, (await response.aread()).decode())
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    error = chunk["error"]
                    self.record(kind, f"in-band {error.get('type')}", error.get("message", ""))
                    return
                num_chunks += 1
                for choice in chunk.get("choices") or []:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    delta = choice.get("delta") or {}
                    content.append(delta.get("content") or choice.get("text") or "")
                    for call in delta.get("tool_calls") or []:
                        function = call.get("function") or {}
                        entry = tool_calls.setdefault(call["index"], {"name": None, "arguments": ""})
                        entry["name"] = function.get("name") or entry["name"]
                        entry["arguments"] += function.get("arguments") or ""
                if cut_after is not None and num_chunks >= cut_after:
                    # Leaving the `async with` before the body ends closes the connection: the server
                    # must notice and abort the request, freeing its KV blocks.
                    self.record(kind, None, outcome="disconnected")
                    return
        calls = [{"function": entry} for entry in tool_calls.values()]
        self.check_answer(kind, body, finish_reason, "".join(content), calls)

    def check_answer(self, kind: str, body: dict, finish_reason, content, tool_calls: list) -> None:
        error = None
        if finish_reason is None:
            error = "no finish_reason"
        elif kind == "tools" and finish_reason == "tool_calls":
            names = {t["function"]["name"] for t in TOOLS}
            error = None if tool_calls else "tool_calls finish without a call"
            for call in tool_calls:
                if call["function"]["name"] not in names:
                    error = "unknown tool"
                try:
                    json.loads(call["function"]["arguments"])
                except ValueError:
                    error = "tool arguments not JSON"
        elif kind == "tools" and body["tool_choice"] == "required" and finish_reason == "stop":
            error = "required tool call missing"
        elif kind == "json_schema" and finish_reason == "stop":
            try:
                json.loads(content or "")
            except ValueError:
                error = "schema answer not JSON"
        detail = f"finish_reason={finish_reason} content={content!r:.120} tool_calls={tool_calls!r:.150}"
        self.record(kind, error, detail)

    async def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            await self.one_request(rng)


def memory_mib(pid: int | None) -> dict:
    """The server's resident memory: all of it (VmRSS), and the part that is not the KV cache.

    NOTE: the CPU KV cache is a shared anonymous mapping (runner.py) whose pages become resident as blocks are
    first written, so VmRSS climbs towards the full KV budget while the free-block queue cycles through the
    blocks (1 GB for the default model), then stops. That is bounded, not a leak: growth is judged on VmRSS
    less RssShmem (the KV mapping is the server's only shared memory).
    """
    if pid is None:
        return {"rss_mib": None, "rss_excl_kv_mib": None}
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssShmem"):
                    fields[name] = int(value.split()[0]) / 1024
    except OSError:
        return {"rss_mib": None, "rss_excl_kv_mib": None}
    rss = fields.get("VmRSS")
    return {
        "rss_mib": None if rss is None else round(rss, 1),
        "rss_excl_kv_mib": None if rss is None else round(rss - fields.get("RssShmem", 0.0), 1),
    }


async def gauges(client: httpx.AsyncClient) -> dict:
    text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return {key: float(values[name]) for key, name in GAUGES.items() if name in values}


async def report(soak: Soak, pid: int | None, started: float, samples: list[dict]) -> None:
    """One JSON line every interval; the samples feed the warm-up memory figure."""
    while True:
        await asyncio.sleep(soak.args.interval)
        sample = {
            "soak": "sample", "seconds": round(time.monotonic() - started), **memory_mib(pid),
            "requests": sum(soak.outcomes.values()), "outcomes": dict(sorted(soak.outcomes.items())),
            "errors": dict(soak.errors),
        }  # fmt: skip
        try:
            sample.update(await gauges(soak.client))
        except httpx.HTTPError as e:
            sample["metrics_error"] = repr(e)
        samples.append(sample)
        tqdm.write(json.dumps(sample), file=sys.stdout)
        sys.stdout.flush()


async def settle(client: httpx.AsyncClient, baseline: dict, seconds: float) -> dict:
    """The gauges once the server is idle again (or as they are after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        now = await gauges(client)
        idle = now["running"] == 0 and now["waiting"] == 0
        if (idle and now["kv_cache_usage"] <= baseline["kv_cache_usage"]) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(1)


async def soak(args, pid: int | None) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        baseline = await gauges(client)
        bar = tqdm(desc="soak", unit="req", file=sys.stderr, disable=None)
        state = Soak(args, client, bar)
        started = time.monotonic()
        deadline = started + args.minutes * 60
        samples: list[dict] = []
        reporter = asyncio.create_task(report(state, pid, started, samples))
        # Workers stop taking new requests at the deadline; those in flight run to their end.
        await asyncio.gather(*(state.worker(args.seed + i, deadline) for i in range(args.concurrency)))
        reporter.cancel()
        bar.close()
        elapsed = time.monotonic() - started
        final = await settle(client, baseline, args.settle)
    end = memory_mib(pid)
    warm = next((s for s in samples if s["seconds"] >= args.warmup_minutes * 60 - 1), {})
    rss_warm, rss_end = warm.get("rss_excl_kv_mib"), end["rss_excl_kv_mib"]
    growth = (rss_end - rss_warm) / rss_warm if rss_warm and rss_end else None
    kv_back = final["kv_cache_usage"] <= baseline["kv_cache_usage"] + 1e-9
    idle = final["running"] == 0 and final["waiting"] == 0
    num_errors = sum(state.errors.values())
    passed = num_errors == 0 and kv_back and idle and (growth is None or growth <= args.max_rss_growth)
    return {
        "soak": "summary", "passed": passed, "url": args.url, "model": args.model,
        "concurrency": args.concurrency, "seconds": round(elapsed), "requests": sum(state.outcomes.values()),
        "requests_per_s": round(sum(state.outcomes.values()) / elapsed, 2),
        "outcomes": dict(sorted(state.outcomes.items())), "errors": dict(state.errors),
        "first_errors": state.first_errors,
        "rss_warm_mib": warm.get("rss_mib"), "rss_end_mib": end["rss_mib"],
        "rss_excl_kv_warm_mib": rss_warm, "rss_excl_kv_end_mib": rss_end,
        "rss_growth": None if growth is None else round(growth, 4), "max_rss_growth": args.max_rss_growth,
        "baseline": baseline, "after_settle": final, "idle": idle, "kv_back_at_baseline": kv_back,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--pid", type=int, default=None, help="the running server's process id (memory)")
    parser.add_argument(
        "--server-command",
        default=f"{sys.executable} -m serval.entrypoints.cli serve --port {{port}} --log-level warning",
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of a request")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between sample lines")
    parser.add_argument("--warmup-minutes", type=float, default=1.0, help="memory is measured from here")
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed fraction, warm-up to end")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds to wait for the server to idle")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    process = None
    pid = args.pid
    if args.url is None:
        port = free_port()
        process, ready_s = start(args.server_command, port, "/tmp/soak-serval.log")
        pid, args.url = process.pid, f"http://127.0.0.1:{port}"
        print(json.dumps({"soak": "started", "pid": pid, "ready_s": round(ready_s, 1)}), flush=True)
    try:
        summary = asyncio.run(soak(args, pid))
    finally:
        if process is not None:
            stop(process)
    print(json.dumps(summary), flush=True)
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
