"""MLA's absorbed per-head products through torch.bmm or kernels.dense_linear_heads, A/B in one process.

The same prefilled requests (bench/step_profile.py's prefilled_engine: random 128-token prompts) run decode
steps with each layer's `heads_kernel` on or off, alternating step by step so that drift on a shared machine
hits both alike; one JSON line of median and 10th-percentile step times of each.

    .venv/bin/python bench/mla_heads_ab.py --model FILE.gguf --batch-size 1 --steps 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from step_profile import prefilled_engine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a DeepSeek-V2/V3 GGUF or directory")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40, help="decode steps of each variant")
    args = parser.parse_args()
    engine = prefilled_engine(args.model, args.batch_size, args.steps + 5)
    attentions = [layer.self_attn for layer in engine.runner.model.layers]
    kernel = attentions[0].heads_kernel
    if kernel is None:
        raise SystemExit("the model's latent attention has no dense_linear_heads kernel (no native kernels?)")
    for _ in range(3):
        engine.step()
    times: dict[str, list[float]] = {"bmm": [], "heads_kernel": []}
    for step in range(args.steps):
        order = ("bmm", "heads_kernel") if step % 2 == 0 else ("heads_kernel", "bmm")
        for variant in order:
            for attention in attentions:
                attention.heads_kernel = kernel if variant == "heads_kernel" else None
            started = time.perf_counter()
            engine.step()
            times[variant].append(time.perf_counter() - started)
    line = {"bench": "mla_heads_ab", "batch_size": args.batch_size, "steps_each": args.steps}
    for variant, seconds in times.items():
        line[variant] = round(statistics.median(seconds) * 1e3, 2)
        line[variant + "_p10"] = round(sorted(seconds)[len(seconds) // 10] * 1e3, 2)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
