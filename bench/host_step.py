"""The host time of a decode step: the engine's own work with the model's forward pass stubbed out.

N requests of 128-token prompts are prefilled, then the model is replaced by a stub that returns zero logits,
so a step is only what the engine and runner do around the forward pass: scheduling, building the batch and
the attention metadata, sampling (an argmax over N x vocabulary logits) and updating the requests. Prints one
JSON line: the median and 10th percentile of `--steps` steps, in ms.

    .venv/bin/python bench/host_step.py --batch-size 64 --label main
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from serval import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--label", default="", help="a name for this run in the JSON line")
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.batch_size, enable_prefix_caching=False)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 100, ignore_eos=True)
    for i in range(args.batch_size):
        engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(128)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    vocab_size = runner.info.vocab_size
    runner.model = lambda ids, positions, kv_caches, meta, logit_rows, lora=None, **kw: torch.zeros(
        len(logit_rows), vocab_size
    )
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    times.sort()
    print(json.dumps({
        "bench": "host_step", "label": args.label, "batch_size": args.batch_size,
        "median_ms": round(statistics.median(times) * 1e3, 3), "p10_ms": round(times[len(times) // 10] * 1e3, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
