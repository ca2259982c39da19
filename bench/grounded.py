"""A workload grounded in its input, for speculative decoding: each request hands the model a ~600-1,200-token
document (a source file or a manual page, stored under bench/workloads/grounded/) and asks for a rewrite with
a small change or for quotations from it, so much of a good answer is already in the prompt.

Starts each system in turn (rounds alternate the order, so drift on a shared machine hits all), sends the
same chat requests (greedy, streamed, at most --max-tokens, the model's own stop), and prints one JSON line
per system, round and concurrency level: per-stream decode tokens/s (tokens after the first over the time
from the first to the last; median over requests), output tokens/s over the level, time to first token, and
the drafts proposed and accepted where the server reports them (serval's vllm:spec_decode_* counters,
llama-server's `timings.draft_n` / `draft_n_accepted`). Then one line per system and level with the medians
over rounds, and its ratio to the first system.

    .venv/bin/python bench/grounded.py --concurrency 1 --rounds 2 \\
        --system "serval=.venv/bin/serval serve --port {port}" \\
        --system "serval-ngram=.venv/bin/serval serve --port {port} --speculative-config '{\\"method\\": \\"ngram\\"}'" \\
        --system "llama-server=$LLAMA_SERVER -m MODEL.gguf --port {port} -np 4 -c 16384"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import free_port, start, stop
from serve import sse_chunks

WORKLOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads", "grounded")


def load_prompts() -> list[str]:
    with open(os.path.join(WORKLOAD, "tasks.json")) as f:
        tasks = json.load(f)
    prompts = []
    for task in tasks:
        with open(os.path.join(WORKLOAD, task["document"])) as f:
            document = f.read()
        fence = f"```{task['wrap']}\n{document}```" if task["wrap"] else document
        prompts.append(f"{fence}\n\n{task['task']}")
    return prompts


@dataclass
class Answer:
    ttft_s: float | None = None
    first_s: float | None = None
    last_s: float | None = None
    num_tokens: int = 0
    num_drafts: int = 0
    num_accepted: int = 0
    text: str = ""
    error: str | None = None
    chunk_tokens: list[int] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.num_tokens < 2 or self.last_s is None or self.last_s <= self.first_s:
            return None
        return (self.num_tokens - 1) / (self.last_s - self.first_s)


async def ask(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Answer:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "timings_per_token": False,
    }
    answer = Answer()
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                answer.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return answer
            async for chunk, now in sse_chunks(response):
                if chunk.get("usage"):
                    answer.num_tokens = chunk["usage"].get("completion_tokens") or answer.num_tokens
                timings = chunk.get("timings") or {}
                answer.num_drafts = timings.get("draft_n", answer.num_drafts)
                answer.num_accepted = timings.get("draft_n_accepted", answer.num_accepted)
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if answer.first_s is None:
                            answer.first_s, answer.ttft_s = now, now - started
                        answer.last_s = now
                        answer.text += content
    except httpx.HTTPError as e:
        answer.error = repr(e)
    return answer


def spec_counters(url: str) -> dict[str, float]:
    """serval's vllm:spec_decode_* counters now (empty where the server has none)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_{name}_total{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


async def run_level(
    url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Answer], float]:
    """Every prompt once (repeated to fill the level at C > number of prompts), C in flight."""
    work = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * concurrency))]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in work:
        queue.put_nowait(prompt)
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            answers.append(await ask(client, model, queue.get_nowait(), max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return answers, time.perf_counter() - started


def summarize(label: str, round_index: int, concurrency: int, answers: list[Answer], elapsed: float,
              counters: dict[str, float]) -> dict:  # fmt: skip
    ok = [a for a in answers if a.error is None]
    rates = [r for r in (a.decode_tokens_per_s for a in ok) if r is not None]
    drafts = counters.get("num_draft_tokens", sum(a.num_drafts for a in ok))
    accepted = counters.get("num_accepted_tokens", sum(a.num_accepted for a in ok))
    steps = counters.get("num_drafts")
    return {
        "bench": "grounded", "system": label, "round": round_index, "concurrency": concurrency,
        "requests": len(answers), "errors": len(answers) - len(ok),
        "first_error": next((a.error for a in answers if a.error), None),
        "output_tokens": sum(a.num_tokens for a in ok),
        "output_tokens_per_s": round(sum(a.num_tokens for a in ok) / elapsed, 1),
        "decode_tokens_per_s_per_stream": round(statistics.median(rates), 1) if rates else None,
        "ttft_ms_p50": round(statistics.median(a.ttft_s for a in ok if a.ttft_s) * 1000, 1) if ok else None,
        "draft_tokens": drafts, "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "mean_accepted_per_draft_step": round(accepted / steps, 2) if steps else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--system", action="append", required=True, help="LABEL=COMMAND with {port}")
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--answers", help="write each system's answers (first round, C=1) to this JSON file")
    args = parser.parse_args()
    systems = [tuple(s.split("=", 1)) for s in args.system]
    prompts = load_prompts()
    levels = [int(c) for c in args.concurrency.split(",")]
    results: list[dict] = []
    answers_by_system: dict[str, list[str]] = {}
    for round_index in range(args.rounds):
        for label, command in systems if round_index % 2 == 0 else systems[::-1]:
            port = free_port()
            process, _ = start(command, port, f"/tmp/bench-grounded-{label}.log")
            url = f"http://127.0.0.1:{port}"
            model = served_model(url)
            try:
                asyncio.run(
                    run_level(url, model, prompts[:1], 1, 8)
                )  # warm-up: first-request costs out of the way
                for concurrency in levels:
                    before = spec_counters(url)
                    answers, elapsed = asyncio.run(
                        run_level(url, model, prompts, concurrency, args.max_tokens)
                    )
                    after = spec_counters(url)
                    counters = {k: after[k] - before.get(k, 0.0) for k in after}
                    line = summarize(label, round_index, concurrency, answers, elapsed, counters)
                    results.append(line)
                    print(json.dumps(line), flush=True)
                    if round_index == 0 and concurrency == levels[0]:
                        answers_by_system[label] = [a.text for a in answers]
            finally:
                stop(process)
    first = systems[0][0]
    for concurrency in levels:

        def median(label: str, key: str, c: int = concurrency) -> float | None:
            values = [r[key] for r in results if r["system"] == label and r["concurrency"] == c and r[key]]
            return statistics.median(values) if values else None

        base_rate, base_tput = (
            median(first, "decode_tokens_per_s_per_stream"),
            median(first, "output_tokens_per_s"),
        )
        for label, _ in systems:
            rate, tput = median(label, "decode_tokens_per_s_per_stream"), median(label, "output_tokens_per_s")
            print(json.dumps({
                "summary": label, "concurrency": concurrency, "rounds": args.rounds,
                "decode_tokens_per_s_per_stream": rate, "output_tokens_per_s": tput,
                f"per_stream_vs_{first}": round(rate / base_rate, 2) if rate and base_rate else None,
                f"throughput_vs_{first}": round(tput / base_tput, 2) if tput and base_tput else None,
                "acceptance_rate": median(label, "acceptance_rate"),
                "mean_accepted_per_draft_step": median(label, "mean_accepted_per_draft_step"),
            }), flush=True)  # fmt: skip
    if args.answers:
        with open(args.answers, "w") as f:
            json.dump(answers_by_system, f, indent=1)


if __name__ == "__main__":
    main()
