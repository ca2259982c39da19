"""The packed matmul (decode, prefill, large decode batches) against PyTorch's matmul over a dense copy of the
same weights, in the model's compute dtype: what the packed integer paths cost beside the copy they replace.

    .venv/bin/python bench/batch_matmul.py --type Q4_0 --shapes 3072x2048,2048x8192 --rows 16,64,137
    .venv/bin/python bench/batch_matmul.py --type Q6_K --shapes 8192x2048 --rows 1 --cold
    .venv/bin/python bench/batch_matmul.py --type Q4_0 --rows 16,128 --int8-activations

--int8-activations times `--batch-activations int8`'s path, the server's default (x rounded to int8 per block).

Each shape is N x K (outputs x inputs) of random weights quantized to the type (the `gguf` package's
quantizer, the tests' round-to-nearest one for the k-quants); one JSON line per shape and row count with both
medians (20 calls each, after one warm-up) and the packed form's bytes. --cold walks a 256 MB buffer before
every call, so that the weights come from memory as in a decode step (not from a cache the previous call
filled): what batch-1 decode costs per matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from serval.runner.kernels import load_cpu_kernels, quantized_matmul
from serval.runner.loader.dequant import block_codes
from serval.runner.quantization import pack_block_codes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.fixtures.quants import quantize  # gguf's quantizer has no k-quants


def median_ms(fn, *args, calls: int = 20, before=None) -> float:
    fn(*args)
    times = []
    for _ in range(calls):
        if before is not None:
            before()
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
    parser.add_argument("--cold", action="store_true", help="weights from memory, not cache, every call")
    parser.add_argument(
        "--int8-activations", action="store_true", help="x rounded to int8 per block (the default)"
    )
    args = parser.parse_args()
    flush = torch.ones(64 * 1024 * 1024) if args.cold else None
    before = (lambda: flush.add_(1)) if args.cold else None
    kernels = load_cpu_kernels(args.variant)
    matmul = quantized_matmul(kernels, args.int8_activations)
    qtype = GGMLQuantizationType[args.type]
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        raw = quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
        dense = (
            torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(n, k).to(dtype)
        )
        packed = pack_block_codes(block_codes(raw, qtype, (n, k)))
        for rows in (int(v) for v in args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            dense_ms = median_ms(torch.nn.functional.linear, x, dense, before=before)
            packed_ms = median_ms(packed.matmul, matmul, x, before=before)
            gflop = 2 * rows * n * k / 1e9
            print(json.dumps({
                "bench": "batch_matmul", "variant": kernels.variant, "amx_tiles": kernels.int8_tile_rows() > 0, "type": args.type, "dtype": args.dtype,
                "int8_activations": args.int8_activations,
                "shape": shape, "rows": rows, "dense_ms": round(dense_ms, 3), "packed_ms": round(packed_ms, 3),
                "packed_over_dense": round(packed_ms / dense_ms, 2), "packed_mb": round(packed.nbytes / 1e6, 2),
                "packed_gb_per_s": round(packed.nbytes / packed_ms / 1e6, 1),
                "dense_gflops": round(gflop / dense_ms * 1e3), "packed_gflops": round(gflop / packed_ms * 1e3),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
