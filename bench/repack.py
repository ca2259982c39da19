"""How fast the loader turns a GGUF matrix's bytes into the packed layout (kernels/gguf_repack.cpp): what a
quantized model's start-up spends per byte of the file, apart from reading it and faulting in fresh memory.

    .venv/bin/python bench/repack.py --types Q4_0,Q4_K,Q6_K,Q8_0 --shape 16384x2048

The bytes are random (packing copies codes and scales bit for bit, whatever they hold), already in memory,
and packed into buffers already touched, so the figure is the repack's own speed: one JSON line per type with
the median of 5 calls and the file bytes per second.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from serval.runner.kernels import load_cpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--shape", default="16384x2048", help="rows x K (K: whole blocks of the type)")
    parser.add_argument("--variant", default=None, help="kernel variant (default: the best this CPU runs)")
    args = parser.parse_args()
    kernels = load_cpu_kernels(args.variant)
    if kernels is None:
        raise SystemExit("the native kernels are not built on this machine: nothing to time")
    rows, k = (int(v) for v in args.shape.split("x"))
    for name in args.types.split(","):
        qtype = GGMLQuantizationType[name]
        block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = torch.randint(0, 256, (rows, k // block_weights * block_bytes), dtype=torch.uint8)
        out = kernels.gguf_packed_buffers(int(qtype), rows, k)
        for buffer in out:
            buffer.view(torch.uint8).fill_(0)  # touched: page faults are not the repack's
        times = []
        for _ in range(5):
            start = time.perf_counter()
            kernels.pack_gguf_blocks_into(raw, int(qtype), rows, k, out, 0)
            times.append(time.perf_counter() - start)
        median = sorted(times)[2]
        print(json.dumps({
            "bench": "repack", "variant": kernels.variant, "type": name, "shape": args.shape,
            "file_mb": round(raw.numel() / 1e6, 1), "median_ms": round(median * 1e3, 2),
            "gb_per_s": round(raw.numel() / median / 1e9, 2),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
