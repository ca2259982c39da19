"""Fidelity of a compared path (bf16, the packed weights, int8 batch activations) to dense fp32 on the engine
test prompts, two ways:
- greedy agreement: each path generates on its own; how many leading tokens match. Brittle: one near-tie
  flipped early changes all that follows, so it counts flips more than it measures how far apart the paths are.
- teacher-forced divergence: both paths read the same tokens (the prompt, then fp32's greedy answer), batched
  as generation batches them (one prefill of every prompt, then decode steps of one row per prompt), and at
  every position the compared path's next-token distribution is held against fp32's: KL(fp32 || compared)
  and whether their top tokens agree. This measures the distance itself, as llama.cpp's perplexity tool does
  for quantization formats.

.venv/bin/python bench/fidelity.py --max-tokens 32
.venv/bin/python bench/fidelity.py --dtype auto --batch-activations int8 [--as-cpu-without-bf16]
.venv/bin/python bench/fidelity.py --dtype auto --kv-cache-dtype fp8_e5m2
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

from serval import LLM, SamplingParams

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # for the shared prompts
from tests.fixtures.fidelity import divergence, fp32_reference, teacher_forced_log_probs
from tests.fixtures.prompts import PROMPTS


def leading_agreement(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", help="the path compared with float32")
    parser.add_argument(
        "--batch-activations", default="int8", help="of the compared path (default: the server's, int8)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="of the compared path (fp8_e5m2: an 8-bit KV cache)"
    )
    parser.add_argument(
        "--as-cpu-without-bf16",
        action="store_true",
        help="resolve --dtype auto as on a CPU without native bf16 (fp32 over the packed weights), on any CPU",
    )
    args = parser.parse_args()
    if args.as_cpu_without_bf16:
        from serval.runner import placement

        placement.cpu_has_native_bf16 = lambda: False  # what resolve_dtype asks; the kernels stay as they are
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompt_ids, reference, reference_log_probs = fp32_reference(args.model, PROMPTS, params)
    compared = LLM(
        args.model,
        dtype=args.dtype,
        batch_activations=args.batch_activations,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    other = [o.outputs[0].token_ids for o in compared.generate(PROMPTS, params)]
    distance = divergence(reference_log_probs, teacher_forced_log_probs(compared, prompt_ids, reference))
    for prompt, ref, got in zip(PROMPTS, reference, other):
        n = leading_agreement(ref, got)
        print(
            json.dumps(
                {"prompt": prompt, "fp32_tokens": len(ref), "agreeing_tokens": n, "identical": ref == got}
            ),
            flush=True,
        )
    identical = sum(ref == got for ref, got in zip(reference, other))
    print(
        json.dumps(
            {
                "summary": f"{identical}/{len(PROMPTS)} prompts identical for {args.max_tokens} tokens",
                "mean_agreeing_tokens": sum(map(leading_agreement, reference, other)) / len(PROMPTS),
                **{
                    k: round(v, 6) if isinstance(v, float) and math.isfinite(v) else v
                    for k, v in distance.items()
                },
                "dtype": args.dtype,
                "batch_activations": args.batch_activations,
                "kv_cache_dtype": args.kv_cache_dtype,
                "as_cpu_without_bf16": args.as_cpu_without_bf16,
            }
        )
    )


if __name__ == "__main__":
    main()
