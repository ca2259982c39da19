"""Decode steps with the compute dtype's KV cache against an 8-bit one (`--kv-cache-dtype fp8_e5m2`), side by side
in one process.

Two engines on the same weights each prefill the same `--batch-size` random 128-token prompts; then they take
turns, `--steps` decode steps at a time for `--rounds` rounds, so that a shared machine's drift hits both alike.
Printed: one JSON line per cache dtype (the median step in ms and its 10th percentile, tokens/s at the median),
then the ratio of the medians (8-bit over the compute dtype's).

    .venv/bin/python bench/kv_cache_dtype.py --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from serval import LLM, SamplingParams


def prefilled(model: str | None, batch_size: int, max_tokens: int, kv_cache_dtype: str):
    llm = LLM(model, max_num_seqs=batch_size, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    rng = random.Random(0)  # the same prompts for both engines
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab_size = engine.runner.info.vocab_size
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randrange(100, vocab_size) for _ in range(128)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="decode steps an engine takes per turn")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kv-cache-dtype", default="fp8_e5m2", help="the 8-bit cache compared")
    args = parser.parse_args()
    max_tokens = args.steps * args.rounds + 8
    engines = {
        name: prefilled(args.model, args.batch_size, max_tokens, name)
        for name in ("auto", args.kv_cache_dtype)
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[name].append((time.perf_counter() - start) * 1e3)
    medians = {}
    for name, engine in engines.items():
        info = engine.runner.info
        medians[name] = statistics.median(times[name])
        print(json.dumps({
            "bench": "kv_cache_dtype", "kv_cache_dtype": info.cache_dtype, "compute_dtype": info.dtype,
            "kernels": info.kernel_variant, "batch_size": args.batch_size, "steps": len(times[name]),
            "median_ms": round(medians[name], 2),
            "p10_ms": round(statistics.quantiles(times[name], n=10)[0], 2),
            "tokens_per_s": round(args.batch_size / medians[name] * 1e3, 1),
        }))  # fmt: skip
    print(json.dumps({"ratio_8bit_over_auto": round(medians[args.kv_cache_dtype] / medians["auto"], 3)}))


if __name__ == "__main__":
    main()
