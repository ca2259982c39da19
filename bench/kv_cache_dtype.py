"""Decode steps with the compute dtype's KV cache against a narrower one (`--kv-cache-dtype int8`, `fp8_e5m2`,
or `bfloat16` where the compute dtype is fp32), side by side in one process.

Two engines on the same weights each prefill the same `--batch-size` random 128-token prompts; then they take
turns, `--steps` decode steps at a time for `--rounds` rounds, so that a shared machine's drift hits both alike.
Printed: one JSON line per cache dtype (the median step in ms and its 10th percentile, tokens/s at the median),
then the ratio of the medians (the narrower cache's over the compute dtype's).

--kernel times the decode attention kernel alone instead: `--batch-size` sequences of `--context` tokens (the
default model's 9 heads over 3 kv heads of 64), every layer's K/V its own memory, three models' worth so that
they come from memory and not the L3 as in a served step; q in this CPU's compute dtype (bf16, or fp32 where
it has no bf16 arithmetic), a cache of that dtype against the narrower ones in turns.

    .venv/bin/python bench/kv_cache_dtype.py --batch-size 64
    .venv/bin/python bench/kv_cache_dtype.py --batch-size 64 --kv-cache-dtype bfloat16
    .venv/bin/python bench/kv_cache_dtype.py --kernel --batch-size 64 --context 160
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from step_profile import prefilled_engine

from serval.runner.attention.cache_dtype import int8_cache_of
from serval.runner.kernels import load_cpu_kernels
from serval.runner.placement import resolve_dtype


def kernel_times(batch_size: int, context: int, rounds: int) -> None:
    kernels = load_cpu_kernels()
    layers, copies, block_size, kv_heads, head_dim = 30, 3, 16, 3, 64
    blocks = batch_size * ((context + block_size - 1) // block_size)
    tables = torch.randperm(blocks).view(batch_size, -1)
    lengths = torch.full((batch_size,), context, dtype=torch.long)
    compute_dtype = resolve_dtype("auto", torch.device("cpu"))
    q = torch.randn(batch_size, 3 * kv_heads, head_dim).to(compute_dtype)
    shape = (blocks, block_size, kv_heads, head_dim)

    as_kind = {
        "float32": lambda t: t,  # an fp32 compute dtype's "auto"
        "bfloat16": lambda t: t.to(torch.bfloat16),
        "fp8_e5m2": lambda t: t.to(torch.float8_e5m2),
        "int8": int8_cache_of,  # codes, and their rows' scales after them
    }
    if compute_dtype != torch.float32:
        del as_kind["float32"]
    caches = {
        kind: [(to_kind(torch.randn(shape)), to_kind(torch.randn(shape))) for _ in range(layers * copies)]
        for kind, to_kind in as_kind.items()
    }
    times: dict[str, list[float]] = {kind: [] for kind in caches}
    for _ in range(rounds * 4):
        for kind, layer_caches in caches.items():
            start = time.perf_counter()
            for k_cache, v_cache in layer_caches:
                kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, head_dim**-0.5)
            times[kind].append((time.perf_counter() - start) * 1e3 / copies)
    for kind, measured in times.items():
        ms = statistics.median(measured)
        cache_bytes = 2 * layers * batch_size * context * kv_heads * caches[kind][0][0].shape[-1]
        cache_bytes *= caches[kind][0][0].element_size()  # (an int8 cache's scales not counted)
        print(json.dumps({
            "bench": "kv_cache_dtype", "kernel": "paged_decode_attention", "kv_cache_dtype": kind,
            "q_dtype": str(compute_dtype).removeprefix("torch."), "kernels": kernels.variant,
            "threads": torch.get_num_threads(), "batch_size": batch_size,
            "context": context, "layers": layers, "median_ms": round(ms, 3),
            "kv_gb_s": round(cache_bytes / ms / 1e6, 1),
        }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="decode steps an engine takes per turn")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--kv-cache-dtype", default="int8", help="the narrower cache compared (int8, fp8_e5m2, bfloat16)"
    )
    parser.add_argument("--kernel", action="store_true", help="the decode attention kernel alone")
    parser.add_argument("--context", type=int, default=160, help="--kernel's tokens a sequence")
    args = parser.parse_args()
    if args.kernel:
        kernel_times(args.batch_size, args.context, args.rounds)
        return
    # The same random 128-token prompts for both engines (step_profile's), room for every step of the turns.
    engines = {
        name: prefilled_engine(args.model, args.batch_size, args.steps * args.rounds, kv_cache_dtype=name)
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
    print(json.dumps({"ratio_over_auto": round(medians[args.kv_cache_dtype] / medians["auto"], 3)}))


if __name__ == "__main__":
    main()
