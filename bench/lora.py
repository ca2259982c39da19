"""The cost of LoRA in a decode step: one batch of decoding sequences, with and without adapters in it.

One process, two engines over the same model: LoRA off, and LoRA on with three random rank-R adapters on
every projection. Each mix runs a batch of B sequences (random prompts, greedy), and the decode steps after the
prefill are timed; mixes alternate over several rounds so that a noisy machine hurts them alike. Prints one
JSON line per mix with the median and 10th-percentile step time.

    .venv/bin/python bench/lora.py                           # the default model, batch 8, rank 16
    .venv/bin/python bench/lora.py --batch-size 32 --rank 64 --dtype float32
    .venv/bin/python bench/lora.py --threads 1               # steadier on a machine shared with others
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time


def write_random_adapter(arch, rank: int, seed: int) -> str:
    """A PEFT-format adapter on q/k/v/o/gate/up/down of every layer, small random A and B."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {  # (in, out) of each module
        "self_attn.q_proj": (arch.hidden_size, q),
        "self_attn.k_proj": (arch.hidden_size, kv),
        "self_attn.v_proj": (arch.hidden_size, kv),
        "self_attn.o_proj": (q, arch.hidden_size),
        "mlp.gate_proj": (arch.hidden_size, arch.intermediate_size),
        "mlp.up_proj": (arch.hidden_size, arch.intermediate_size),
        "mlp.down_proj": (arch.intermediate_size, arch.hidden_size),
    }
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (num_in, num_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, num_in, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(num_out, rank, generator=generator) * 0.01
    directory = tempfile.mkdtemp(prefix="serval-bench-lora-")
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return directory


def decode_step_times(engine, names: list[str | None], num_steps: int, seed: int) -> list[float]:
    from serval.sampling import SamplingParams

    rng = random.Random(seed)
    vocab_size = engine.runner.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 1, ignore_eos=True)
    for i, name in enumerate(names):
        prompt = [rng.randrange(100, vocab_size) for _ in range(32)]
        engine.add_request(f"{seed}-{i}", prompt, params, lora_name=name)
    engine.step()  # every prefill (32 tokens each fit one step's budget)
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=20, help="decode steps timed per round and mix")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    from serval.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
    from serval.engine.engine import Engine

    def engine(enable_lora: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=ModelConfig(model=args.model, dtype=args.dtype),
                cache=CacheConfig(enable_prefix_caching=False),
                scheduler=SchedulerConfig(max_num_batched_tokens=max(512, 32 * args.batch_size)),
                lora=LoraConfig(enable_lora=enable_lora, max_loras=4, max_lora_rank=args.rank),
            )
        )

    plain, with_lora = engine(False), engine(True)
    for i, name in enumerate(("a", "b", "c")):
        path = write_random_adapter(with_lora.runner.arch, args.rank, seed=i)
        with_lora.add_lora(name, with_lora.runner.read_lora(path))
    b = args.batch_size
    mixes = {
        "LoRA off": (plain, [None] * b),
        "LoRA on, no adapter in the batch": (with_lora, [None] * b),
        "one adapter for every sequence": (with_lora, ["a"] * b),
        "half base, half one adapter": (with_lora, [None, "a"] * (b // 2)),
        "a quarter each: base and three adapters": (with_lora, [None, "a", "b", "c"] * (b // 4)),
    }
    times: dict[str, list[float]] = {mix: [] for mix in mixes}
    for round_index in range(args.rounds):
        for mix, (eng, names) in mixes.items():
            times[mix] += decode_step_times(eng, names, args.num_steps, seed=round_index)
    for mix, values in times.items():
        values.sort()
        print(
            json.dumps(
                {
                    "mix": mix,
                    "batch_size": b,
                    "rank": args.rank,
                    "dtype": with_lora.runner.info.dtype,
                    "median_step_ms": round(statistics.median(values) * 1000, 2),
                    "p10_step_ms": round(values[len(values) // 10] * 1000, 2),
                    "min_step_ms": round(values[0] * 1000, 2),
                    "num_steps": len(values),
                }
            )
        )


if __name__ == "__main__":
    main()
