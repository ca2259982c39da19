"""Tensor parallelism's cost or gain on this machine: TP=1 against TP=N through serval.LLM, same model and dtype.

For each size, one JSON line per measure:
- ttft: one prompt of --prompt-len random tokens, 1 output token (prefill plus one step), median of --repeats;
- decode_1: one sequence generating --output-len tokens: output tokens/s;
- batch: --batch-size sequences (prompts of 128 tokens) generating --output-len tokens each: output tokens/s.
Prompts are random token ids, distinct per run, and the prefix cache is off. The CPU's model name and SIMD flags
go in every line: figures from another CPU are not comparable.

    .venv/bin/python bench/tensor_parallel.py                        # the default model, auto dtype, TP 1 and 2
    .venv/bin/python bench/tensor_parallel.py --sizes 1,2,4 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_description() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "unknown CPU"
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?"
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return f"{name} [{' '.join(f for f in _FLAGS if f in flags)}] x{text.count('processor')}"


def prompts(count: int, length: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(length)]} for _ in range(count)
    ]


def measure(args, size: int, cpu: str) -> None:
    from serval import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.model, dtype=args.dtype, tensor_parallel_size=size, enable_prefix_caching=False,
        max_num_seqs=max(args.batch_size, 1),
    )  # fmt: skip
    load_s = time.perf_counter() - started
    info = llm.engine.runner.info
    vocab = info.vocab_size

    def report(measure_name: str, **figures) -> None:
        line = {"tensor_parallel_size": size, "measure": measure_name, **figures, "dtype": info.dtype,
                "threads_per_rank": info.num_threads, "load_s": round(load_s, 1), "cpu": cpu}  # fmt: skip
        print(json.dumps(line), flush=True)

    try:
        seed = 1000 * size
        llm.generate(prompts(2, 16, vocab, seed), SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        times = []
        for i in range(args.repeats):
            batch = prompts(1, args.prompt_len, vocab, seed + 1 + i)
            t0 = time.perf_counter()
            llm.generate(batch, first)
            times.append(time.perf_counter() - t0)
        report("ttft", prompt_len=args.prompt_len, median_s=round(statistics.median(times), 4))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for name, count in (("decode_1", 1), ("batch", args.batch_size)):
            batch = prompts(count, 128 if count > 1 else 16, vocab, seed + 100 + count)
            t0 = time.perf_counter()
            outputs = llm.generate(batch, params)
            elapsed = time.perf_counter() - t0
            num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            report(
                name, sequences=count, output_tokens=num_tokens, tokens_per_s=round(num_tokens / elapsed, 1)
            )
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf or HF directory (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cpu = cpu_description()
    for size in (int(s) for s in args.sizes.split(",")):
        measure(args, size, cpu)


if __name__ == "__main__":
    main()
