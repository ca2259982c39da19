"""Time to prefill one prompt through the engine (what a request's time to first token is made of, without
HTTP): one request of `--tokens` token ids at a time, prefix caching off, one output token.

    .venv/bin/python bench/prefill.py --model FILE [--batch-activations int8] --tokens 128 --runs 6

Prints one JSON line: every run's milliseconds and their median. The first run is a warm-up, not counted.

--kernel times the prefill attention kernel alone instead: one prompt of `--tokens` new tokens over 30 layers'
caches of their own (the default model's 9 heads over 3 kv heads of 64, blocks of 16 in a shuffled table), q and
the cache in this CPU's compute dtype; each run is all 30 layers, and the line adds their rate in GFLOP/s (the
causal half of q.k and of p.v).

    .venv/bin/python bench/prefill.py --kernel --tokens 448 --runs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from serval import LLM, SamplingParams
from serval.runner.kernels import load_cpu_kernels
from serval.runner.placement import resolve_dtype


def kernel_times(tokens: int, runs: int) -> None:
    kernels = load_cpu_kernels()
    layers, block_size, heads, kv_heads, head_dim = 30, 16, 9, 3, 64
    dtype = resolve_dtype("auto", torch.device("cpu"))
    blocks = (tokens + block_size - 1) // block_size
    table = torch.randperm(blocks).view(1, -1)
    shape = (blocks, block_size, kv_heads, head_dim)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    starts, lengths = torch.tensor([0]), torch.tensor([tokens])
    times_ms = []
    for run in range(runs + 1):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernels.paged_prefill_attention(
                q, k_cache, v_cache, table, starts, lengths, lengths, head_dim**-0.5, out, 0, torch.empty(0)
            )
        if run > 0:
            times_ms.append(round((time.perf_counter() - start) * 1e3, 2))
    flop = layers * heads * head_dim * 4 * tokens * (tokens + 1) / 2
    median = round(statistics.median(times_ms), 2)
    print(
        json.dumps(
            {
                "bench": "prefill_attention", "kernels": kernels.variant, "dtype": str(dtype).removeprefix("torch."),
                "tokens": tokens, "layers": layers, "runs_ms": times_ms, "median_ms": median,
                "gflop_s": round(flop / median / 1e6, 1),
            }
        )
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a GGUF file or model directory (default: the embedded model)"
    )
    parser.add_argument(
        "--batch-activations", default="auto", help="auto, float32 or int8 (configuration.md)"
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--kernel", action="store_true", help="the prefill attention kernel alone")
    args = parser.parse_args()
    if args.kernel:
        kernel_times(args.tokens, args.runs)
        return
    llm = LLM(args.model, enable_prefix_caching=False, batch_activations=args.batch_activations)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times_ms = []
    for run in range(args.runs + 1):
        # distinct ids each run, well inside any vocabulary
        prompt = [100 + (run * 7 + j) % 5000 for j in range(args.tokens)]
        engine.add_request(f"prefill-{run}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if run > 0:
            times_ms.append(round((time.perf_counter() - start) * 1e3, 1))
    print(
        json.dumps(
            {
                "model": args.model or "default",
                "batch_activations": args.batch_activations,
                "tokens": args.tokens,
                "runs_ms": times_ms,
                "median_ms": round(statistics.median(times_ms), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
