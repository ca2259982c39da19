"""Where a decode step's time goes: each projection, attention, norms, the LM head, and the rest of the step.

N requests of 128-token prompts are prefilled; then the step runs layer by layer (the fused DecodeStack off,
so that each part can be timed: forward hooks around every module) for `--steps` steps. Printed, one JSON
line per part: milliseconds a step (median over steps), its share of the step, and where it applies GFLOP/s
(2 M N K a matmul) and the packed weights' bytes read per second. The fused step's own median comes first,
for scale: the layer-by-layer total is the same work with more dispatch.

    .venv/bin/python bench/step_profile.py --batch-size 64
    .venv/bin/python bench/step_profile.py --model FILE.gguf --batch-size 16
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time

from serval import LLM, SamplingParams
from serval.runner.layers import Linear, RMSNorm


def prefilled_engine(model: str | None, batch_size: int, steps: int):
    llm = LLM(model, max_num_seqs=batch_size, enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 50, ignore_eos=True)
    vocab_size = engine.runner.info.vocab_size
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randrange(100, vocab_size) for _ in range(128)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    return engine


def median_step_ms(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def part_of(name: str, module) -> str | None:
    """The part a module's time is counted in (None: counted through its children)."""
    if isinstance(module, Linear):
        return "linear:" + name.rsplit(".", 1)[-1]
    if isinstance(module, RMSNorm):
        return "norms"
    if name.endswith("self_attn"):
        return "attention (less its projections)"
    if name.endswith(".mlp"):
        return "mlp (less its projections)"
    return None


def attach_timers(model, spans: dict[str, float], flops: dict[str, float], weight_bytes: dict[str, int]):
    """Hooks that add each module's seconds to spans[part]; a module's children are taken off its part."""
    stack: list[list] = []

    def before(module, args):
        stack.append([time.perf_counter(), 0.0])

    def after_for(part: str, module):
        def after(_, args, output):
            started, children = stack.pop()
            elapsed = time.perf_counter() - started
            spans[part] += elapsed - children
            if stack:
                stack[-1][1] += elapsed
            if part.startswith("linear:"):
                x = args[0]
                flops[part] += 2.0 * x.shape[0] * module.out_features * module.in_features
                packed = getattr(module, "packed", None)
                weight_bytes[part] += packed.nbytes if packed is not None else module.weight.nbytes

        return after

    for name, module in model.named_modules():
        part = part_of(name, module)
        if part is not None:
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after_for(part, module))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    engine = prefilled_engine(args.model, args.batch_size, args.steps)
    model = engine.runner.model
    fused_ms = median_step_ms(engine, args.steps)
    model.decode_stack = None
    spans: dict[str, float] = collections.defaultdict(float)
    flops: dict[str, float] = collections.defaultdict(float)
    weight_bytes: dict[str, int] = collections.defaultdict(int)
    forward: list[float] = []
    final_norm_done: list[float] = []

    def forward_done(module, args, output) -> None:
        now = time.perf_counter()
        forward[-1] += now
        spans["lm head (after the final norm)"] += now - final_norm_done[-1]

    model.register_forward_pre_hook(lambda m, a: forward.append(-time.perf_counter()))
    model.register_forward_hook(forward_done)
    attach_timers(model, spans, flops, weight_bytes)
    model.norm.register_forward_hook(lambda m, a, o: final_norm_done.append(time.perf_counter()))
    median_step_ms(engine, 2)  # warm-up of the layer path
    spans.clear(), flops.clear(), weight_bytes.clear(), forward.clear(), final_norm_done.clear()
    layered_ms = median_step_ms(engine, args.steps)
    steps = args.steps
    info = engine.runner.info
    print(json.dumps({
        "bench": "step_profile", "batch_size": args.batch_size, "kernels": info.kernel_variant,
        "dtype": info.dtype, "batch_activations": info.batch_activations,
        "fused_step_ms": round(fused_ms, 2), "layered_step_ms": round(layered_ms, 2),
    }))  # fmt: skip
    timed = sum(spans.values()) * 1e3 / steps
    forward_ms = sum(forward) * 1e3 / steps
    parts = dict(spans)
    parts["rest of the forward (embedding, residual adds, dispatch)"] = (forward_ms - timed) / 1e3 * steps
    parts["outside the forward (scheduling, metadata, sampling, updates)"] = (
        (layered_ms - forward_ms) / 1e3 * steps
    )
    for part, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        ms = seconds * 1e3 / steps
        line = {"part": part, "ms": round(ms, 3), "share": round(ms / layered_ms, 3)}
        if flops.get(part):
            line["gflop_s"] = round(flops[part] / seconds / 1e9, 1)
            line["weight_gb_s"] = round(weight_bytes[part] / seconds / 1e9, 1)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
