"""One sparse MoE layer's routed experts: serval's one-call kernel (kernels.moe_experts: every (expert, block of
rows) item in parallel) against the same packed matmuls called one expert after another (each matmul
parallel over its own rows, as llama.cpp's mul_mat_id walks the used experts), on random packed weights of a
real shape. Both read only the experts the tokens chose.

    .venv/bin/python bench/moe_layer.py --type Q4_0 --tokens 1,16,512
    .venv/bin/python bench/moe_layer.py --experts 32 --top-k 4 --hidden 2880 --inter 2880 --tokens 1,16

Routing is random (each token picks top-k distinct experts uniformly), so a step of T tokens touches about
E (1 - (1 - k/E)^T) experts, as a model's router roughly does. One JSON line per token count: both medians
(10 calls after a warm-up, every call reading the weights from memory: the stacks are far larger than the
cache), the distinct experts touched, and the bytes of those experts' weights.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from serval.runner.kernels import load_cpu_kernels, quantized_matmul


def random_stack(kernels, qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> list[torch.Tensor]:
    """A (rows, cols) packed matrix of random blocks (random codes and small random fp16 scales)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0):  # the fp16 d of each block: small
        scales = (rng.standard_normal((rows, cols // block)) * 1e-3).astype(np.float16).view(np.uint8)
        raw.reshape(rows, cols // block, size)[:, :, :2] = scales.reshape(rows, cols // block, 2)
    return kernels.pack_gguf_blocks(torch.from_numpy(raw), int(qtype), rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q8_0"])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--tokens", default="1,16,512")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    qtype = GGMLQuantizationType[args.type]
    E, k, H, inter = args.experts, args.top_k, args.hidden, args.inter
    gate = random_stack(kernels, qtype, E * inter, H, 1)
    up = random_stack(kernels, qtype, E * inter, H, 2)
    down = random_stack(kernels, qtype, E * H, inter, 3)
    matmul = quantized_matmul(kernels, True)
    bytes_per_expert = sum(t.numel() * t.element_size() for s in (gate, up, down) for t in s) / E

    def expert_rows(stack: list[torch.Tensor], expert: int, rows: int, x: torch.Tensor) -> torch.Tensor:
        groups = stack[0].shape[0] // E
        parts = [t[expert * groups : (expert + 1) * groups] if t.numel() else t for t in stack]
        return matmul(x, *parts, rows)

    def one_expert_at_a_time(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], H)
        flat = ids.flatten()
        for e in flat.unique().tolist():
            slots = (flat == e).nonzero().flatten()
            xe = x[slots // k]
            h = torch.nn.functional.silu(expert_rows(gate, e, inter, xe)) * expert_rows(up, e, inter, xe)
            out.index_add_(0, slots // k, expert_rows(down, e, H, h) * weights.flatten()[slots, None])
        return out

    def in_one_call(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        none = torch.empty(0)
        return kernels.moe_experts(
            x, ids, weights, gate, up, down, none, none, none, E, inter, H, 0, 1.702, 7.0, True
        )

    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        torch.manual_seed(num_tokens)
        x = torch.randn(num_tokens, H)
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(num_tokens)])
        weights = torch.softmax(torch.randn(num_tokens, k), dim=-1)
        distinct = int(ids.unique().numel())
        result = {
            "tokens": num_tokens, "type": args.type, "distinct_experts": distinct,
            "experts_mb": round(distinct * bytes_per_expert / 1e6, 1),
            "max_abs_diff": (in_one_call(x, ids, weights) - one_expert_at_a_time(x, ids, weights)).abs().max().item(),
        }  # fmt: skip
        for name, fn in (("moe_experts_ms", in_one_call), ("one_expert_at_a_time_ms", one_expert_at_a_time)):
            times = []
            for _ in range(args.calls):
                start = time.perf_counter()
                fn(x, ids, weights)
                times.append(time.perf_counter() - start)
            result[name] = round(1e3 * float(np.median(times)), 3)
        result["read_gb_per_s"] = round(result["experts_mb"] / result["moe_experts_ms"], 2)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
