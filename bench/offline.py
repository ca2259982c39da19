"""Offline throughput: batches of ~128-token prompts each generating 128 tokens, through serval.LLM.

Prints one JSON line per batch size: output tokens/s (all generated tokens / wall time, prefill included),
and the wall time. Prompts are random token ids, distinct per sequence, so the prefix cache finds nothing.

    .venv/bin/python bench/offline.py --batch-sizes 1,16,64
    .venv/bin/python bench/offline.py --engine hf --batch-sizes 1,16     # Hugging Face generate, same weights
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from tqdm import tqdm


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: special tokens live there in most vocabularies.
    return [[rng.randrange(100, vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]


def run_serval(args, batch_sizes: list[int]) -> None:
    from serval import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(batch_sizes), enable_prefix_caching=False)
    vocab_size = llm.engine.runner.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in make_prompts(2, 16, vocab_size, 0)], params)  # warm-up
    for batch_size in tqdm(batch_sizes, desc="batch sizes", disable=None, file=sys.stderr):
        prompts = make_prompts(batch_size, args.prompt_len, vocab_size, seed=batch_size)
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - started
        num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        report(args, "serval", llm.engine.runner.info.dtype, batch_size, num_generated, elapsed)


def run_hf(args, batch_sizes: list[int]) -> None:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from serval.model_source import resolve_model

    source = resolve_model(args.model)
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if source.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(source.path), gguf_file=os.path.basename(source.path), dtype=torch.float32
        ).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    model.eval()
    vocab_size = model.config.vocab_size
    for batch_size in tqdm(batch_sizes, desc="batch sizes", disable=None, file=sys.stderr):
        prompts = torch.tensor(make_prompts(batch_size, args.prompt_len, vocab_size, seed=batch_size))
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - started
        report(
            args,
            "hf-transformers",
            str(dtype).removeprefix("torch."),
            batch_size,
            (out.shape[1] - prompts.shape[1]) * batch_size,
            elapsed,
        )


def report(args, engine: str, dtype: str, batch_size: int, num_generated: int, elapsed: float) -> None:
    print(
        json.dumps(
            {
                "bench": "offline",
                "engine": engine,
                "model": args.model or "default (SmolLM2-135M-Instruct Q4_1)",
                "dtype": dtype,
                "batch_size": batch_size,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "generated_tokens": num_generated,
                "seconds": round(elapsed, 3),
                "output_tokens_per_s": round(num_generated / elapsed, 1),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (default: the embedded model)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--engine", default="serval", choices=["serval", "hf"])
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    (run_serval if args.engine == "serval" else run_hf)(args, batch_sizes)


if __name__ == "__main__":
    main()
