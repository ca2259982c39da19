"""Replicas on Ray Serve: 2 replicas x 1 thread against 1 replica x 2 threads (and the plain single process),
and the prefix-cache hit rate of a shared-prefix load under prefix-aware against round-robin routing.

Throughput and TTFT: each shape is started, bench/serve.py runs its concurrency levels (streamed chat,
distinct prompts), and the shape is stopped (by process id) before the next starts. Hit rate: a 2 x 1
server per routing policy gets `--num-documents` shared heads (~`--document-words` words each) x
`--questions` short questions, in a shuffled order, `--hit-concurrency` at a time; the rate is the
replicas' prefix-cache hits over the prompt tokens looked up (their /health counters, before and after).

    .venv/bin/python bench/replicas.py --concurrency 1,16,64 --max-tokens 64

One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import free_port, run_levels, start, stop
from serve import make_prompt

SHAPES = {
    "2x1": "--replicas 2 --replica-threads 1",
    "1x2": "--replicas 1 --replica-threads 2",
    "single": "",  # one engine in the server's own process (no Ray), its default threads: the 2 cores
}


def serval_command(port: int, extra: str, args) -> str:
    return (
        f"{sys.executable} -m serval.entrypoints.cli serve --host 127.0.0.1 --port {port} --log-level warning "
        f"--kv-cache-memory-bytes {args.kv_cache} {extra}"
    )


def wait_for_replicas(port: int, num: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        if "replicas" not in body or len(body["replicas"]) == num:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{num} replicas did not report in {timeout}s")


def prefix_counters(port: int) -> tuple[int, int]:
    """(hits, queries) summed over the replicas, after a pause that lets every replica report again."""
    time.sleep(3)
    replicas = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["replicas"]
    return sum(r["num_prefix_cache_hits"] for r in replicas), sum(
        r["num_prefix_cache_queries"] for r in replicas
    )


async def shared_prefix_load(port: int, args) -> None:
    rng = random.Random(0)
    documents = [make_prompt(rng, args.document_words) for _ in range(args.num_documents)]
    prompts = [
        f"{doc}\n\nQuestion {q}: what is word {q}?" for doc in documents for q in range(args.questions)
    ]
    rng.shuffle(prompts)
    todo = iter(prompts)

    async def worker(client: httpx.AsyncClient, model: str) -> None:
        for prompt in todo:
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
            response = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            response.raise_for_status()

    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(worker(client, model) for _ in range(args.hit_concurrency)))


def hit_rate(routing: str, args) -> dict:
    port = free_port()
    extra = f"{SHAPES['2x1']} --replica-routing {routing}"
    process, _ = start(serval_command(port, extra, args), port, f"/tmp/bench-replicas-{routing}.log")
    try:
        wait_for_replicas(port, 2)
        hits0, queries0 = prefix_counters(port)
        started = time.monotonic()
        asyncio.run(shared_prefix_load(port, args))
        seconds = time.monotonic() - started
        hits, queries = prefix_counters(port)
    finally:
        stop(process)
    return {
        "bench": "replicas-prefix", "routing": routing, "documents": args.num_documents,
        "questions": args.questions, "concurrency": args.hit_concurrency, "seconds": round(seconds, 1),
        "prefix_cache_hit_rate": round((hits - hits0) / max(1, queries - queries0), 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="2x1,1x2,single", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=100, help="words of prompt (bench/serve.py)")
    parser.add_argument("--num-requests", type=int, default=0, help="per level (default: bench/serve.py's)")
    parser.add_argument("--kv-cache", default="512MiB", help="per replica (and for the single process)")
    parser.add_argument("--num-documents", type=int, default=8)
    parser.add_argument("--document-words", type=int, default=300)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--hit-concurrency", type=int, default=4)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-hit-rate", action="store_true")
    args = parser.parse_args()
    if not args.skip_throughput:
        for shape in args.shapes.split(","):
            port = free_port()
            process, startup_s = start(
                serval_command(port, SHAPES[shape], args), port, f"/tmp/bench-{shape}.log"
            )
            try:
                if shape != "single":
                    wait_for_replicas(port, int(shape[0]))
                print(
                    json.dumps({"bench": "replicas-startup", "shape": shape, "seconds": round(startup_s, 1)})
                )
                run_levels(shape, port, args)
            finally:
                stop(process)
    if not args.skip_hit_rate:
        for routing in ("prefix", "round_robin"):
            print(json.dumps(hit_rate(routing, args)), flush=True)


if __name__ == "__main__":
    main()
