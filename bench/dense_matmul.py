"""Dense matmuls: the batch-invariant kernel (kernels.dense_linear) against the path it replaces, side by side.

For each matrix of a model shape (Llama-3.2-1B's: 2048x2048, 8192x2048, 2048x8192 and a
49152x2048 slice of the head), weight dtype and row count, the schemes are timed in turn,
round robin over `--repeats` rounds in one process, so drift on a shared machine hits them alike; one JSON line
each with the median ms and the ratio to the first scheme.

Schemes for weights of the compute dtype (safetensors checkpoints, `--dtype float32`):
  torch       what Linear did before: bf16_linear_small_batch up to 8 rows for bf16, else F.linear
  invariant   kernels.dense_linear at every row count
GGUF F16/BF16 matrices went through half_linear.cpp, which dense_linear replaced (its numbers: commit d8f1b8f's
version of this script, `--f16-weights`).

    .venv/bin/python bench/dense_matmul.py --rows 1,4,16,64,512 --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name -> (N, K): Llama-3.2-1B's, the head a 49152-row slice of its 128256
    "o": (2048, 2048),
    "up": (8192, 2048),
    "down": (2048, 8192),
    "head": (49152, 2048),
}


def schemes(kernels, dtype: torch.dtype) -> dict:
    def before(x, w):
        if dtype == torch.bfloat16 and x.shape[0] <= 8:
            return kernels.bf16_linear_small_batch(x, w)
        return F.linear(x, w)

    return {"torch": before, "invariant": kernels.dense_linear}


def time_once(fn, x, w, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x, w)
    return (time.perf_counter() - start) * 1000 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes (weights the same)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-ms", type=float, default=150.0, help="per timing, roughly")
    parser.add_argument("--variant", default=None)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args()

    from serval.runner.kernels import load_cpu_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels(args.variant)
    torch.manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for weight_dtype in [dtype]:
            for shape in args.shapes.split(","):
                n, k = SHAPES[shape]
                w = (torch.randn(n, k) * 0.02).to(weight_dtype)
                named = schemes(kernels, dtype)
                for rows in [int(r) for r in args.rows.split(",")]:
                    x = torch.randn(rows, k).to(dtype)
                    first = time_once(named["invariant"], x, w, 1)  # warm-up, and the call count
                    calls = max(1, int(args.budget_ms / max(first, 1e-3)))
                    times = {name: [] for name in named}
                    for _ in range(args.repeats):
                        for name, fn in named.items():
                            times[name].append(time_once(fn, x, w, calls))
                    medians = {name: statistics.median(t) for name, t in times.items()}
                    base = next(iter(medians.values()))
                    print(
                        json.dumps(
                            {
                                "variant": kernels.variant,
                                "threads": torch.get_num_threads(),
                                "compute": dtype_name,
                                "weights": str(weight_dtype).removeprefix("torch."),
                                "shape": f"{shape} {n}x{k}",
                                "rows": rows,
                                **{f"{name}_ms": round(m, 3) for name, m in medians.items()},
                                "invariant_vs_before": round(base / medians["invariant"], 3),
                            }
                        ),
                        flush=True,
                    )


if __name__ == "__main__":
    main()
