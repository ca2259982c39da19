"""Time to prefill one prompt through the engine (what a request's time to first token is made of, without
HTTP): one request of `--tokens` token ids at a time, prefix caching off, one output token.

    .venv/bin/python bench/prefill.py --model FILE [--batch-activations int8] --tokens 128 --runs 6

Prints one JSON line: every run's milliseconds and their median. The first run is a warm-up, not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from serval import LLM, SamplingParams


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
    args = parser.parse_args()
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
