"""The packed matmul past 8 rows (prefill, large decode batches) against PyTorch's matmul over a dense copy of
the same weights, in the model's compute dtype: what `quantized_tiles.cpp` costs beside the copy it replaces.

    .venv/bin/python bench/batch_matmul.py --type Q4_0 --shapes 3072x2048,2048x8192 --rows 16,64,137

Each shape is N x K (outputs x inputs) of random weights quantized by the `gguf` package; one JSON line per
shape and row count with both medians (20 calls each, after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from serval.runner.kernels import load_cpu_kernels
from serval.runner.loader.dequant import block_codes
from serval.runner.quantization import pack_block_codes


def median_ms(fn, *args, calls: int = 20) -> float:
    fn(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--type", default="Q4_0", help="a GGML block type (Q4_0, Q4_K, Q6_K, ...)")
    parser.add_argument("--shapes", default="960x576,3072x2048,2048x8192")
    parser.add_argument("--rows", default="9,16,32,64,137")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--variant", default=None, help="kernel variant (default: the best this CPU runs)")
    args = parser.parse_args()
    kernels = load_cpu_kernels(args.variant)
    qtype = GGMLQuantizationType[args.type]
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
        dense = (
            torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(n, k).to(dtype)
        )
        packed = pack_block_codes(block_codes(raw, qtype, (n, k)))
        for rows in (int(v) for v in args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            dense_ms = median_ms(torch.nn.functional.linear, x, dense)
            packed_ms = median_ms(packed.matmul, kernels.quantized_linear, x)
            gflop = 2 * rows * n * k / 1e9
            print(json.dumps({
                "bench": "batch_matmul", "variant": kernels.variant, "type": args.type, "dtype": args.dtype,
                "shape": shape, "rows": rows, "dense_ms": round(dense_ms, 3), "packed_ms": round(packed_ms, 3),
                "packed_over_dense": round(packed_ms / dense_ms, 2),
                "dense_gflops": round(gflop / dense_ms * 1e3), "packed_gflops": round(gflop / packed_ms * 1e3),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
