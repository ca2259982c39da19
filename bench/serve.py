"""Load generator for any OpenAI-compatible server: streaming chat completions at fixed concurrency levels.

For each concurrency C it keeps C requests in flight until `--num-requests` have finished, reads each SSE
stream, and reports: output tokens/s over the whole level, time to first token (mean, p50, p99) and
inter-token latency per stream (mean, p50, p99). Prompts are ~`--prompt-tokens` words of varied text, so no
two share more than the chat template's head. One JSON line per level on stdout, a progress bar on stderr.

    .venv/bin/serval serve --port 8000 &
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1,16,64

Output tokens are counted from `usage.completion_tokens` (stream_options.include_usage) when the server
sends it, else one per content chunk. `ignore_eos` is sent (vLLM and serval honour it; llama.cpp ignores
unknown fields), so every request generates `--max-tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

WORDS = [
    "river",
    "mountain",
    "quiet",
    "engine",
    "paper",
    "orange",
    "window",
    "system",
    "garden",
    "market",
    "silver",
    "answer",
    "winter",
    "carbon",
    "signal",
    "theory",
    "harbor",
    "violet",
    "number",
    "forest",
    "planet",
    "bridge",
    "letter",
    "summer",
    "castle",
    "motion",
    "copper",
    "island",
    "pattern",
    "museum",
    "cotton",
    "rocket",
    "valley",
    "lantern",
    "circle",
    "meadow",
    "thunder",
    "crystal",
    "marble",
    "anchor",
    "velvet",
]


@dataclass
class RequestResult:
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None


def make_prompt(rng: random.Random, num_words: int) -> str:
    return "Continue this list with more words: " + " ".join(rng.choice(WORDS) for _ in range(num_words))


async def sse_chunks(response: httpx.Response) -> AsyncIterator[tuple[dict, float]]:
    """Each `data:` chunk of a streamed response, parsed, with when it arrived (perf_counter)."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :]), time.perf_counter()


async def one_request(client: httpx.AsyncClient, args, prompt: str) -> RequestResult:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    result = RequestResult()
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for chunk, now in sse_chunks(response):
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"].get(
                        "completion_tokens", result.num_output_tokens
                    )
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        if result.ttft_s is None:
                            result.ttft_s = now - started
                        result.token_times.append(now)
        if result.num_output_tokens == 0:
            result.num_output_tokens = len(result.token_times)
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


async def run_level(args, concurrency: int) -> dict:
    rng = random.Random(concurrency)
    prompts = [make_prompt(rng, args.prompt_tokens) for _ in range(args.num_requests)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list[RequestResult] = []
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    bar = tqdm(total=len(prompts), desc=f"C={concurrency}", unit="req", file=sys.stderr, disable=None)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            results.append(await one_request(client, args, prompt))
            bar.update(1)

    async with httpx.AsyncClient(
        base_url=args.url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    bar.close()
    return summarize(args, concurrency, results, elapsed)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(args, concurrency: int, results: list[RequestResult], elapsed: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    num_tokens = sum(r.num_output_tokens for r in ok)

    def stats(values: list[float]) -> dict:
        if not values:
            return {}
        return {
            "mean": round(statistics.fmean(values), 1),
            "p50": round(percentile(values, 0.5), 1),
            "p99": round(percentile(values, 0.99), 1),
        }

    return {
        "bench": "serve",
        "label": args.label,
        "url": args.url,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "max_tokens": args.max_tokens,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(num_tokens / elapsed, 1),
        "ttft_ms": stats(ttfts),
        "itl_ms": stats(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="per level (default: 2 x C, at least 4)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=100, help="words of prompt text (~1.3 tokens each)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--label", default="", help="a name for this server in the JSON lines")
    args = parser.parse_args()
    if args.model is None:
        models = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"]
        args.model = models[0]["id"]
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        level_args = argparse.Namespace(**vars(args))
        level_args.num_requests = args.num_requests or max(4, 2 * concurrency)
        print(json.dumps(asyncio.run(run_level(level_args, concurrency))), flush=True)


if __name__ == "__main__":
    main()
