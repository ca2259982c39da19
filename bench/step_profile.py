"""Where a decode step's time goes: each projection, attention, norms, the LM head, and the rest of the step.

N requests of 128-token prompts are prefilled; then the step runs layer by layer (the fused DecodeStack off,
so that each part can be timed: forward hooks around every module) for `--steps` steps. Printed, one JSON
line per part: milliseconds a step (median over steps), its share of the step, and its rate against the
roofline that bounds it: GFLOP/s for the matmuls (2 M N K; the LM head's M is the rows that sample) with the
packed weights' bytes read per second, and for a decode step's attention the K/V bytes it reads per second
(every sequence's context, every layer). The fused step's own median comes first, for scale: the
layer-by-layer total is the same arithmetic with more dispatch, and with the residual adds and SwiGLU as
passes of their own, which the fused step does inside its int8 matmuls (kernels/group_output.h).

--prefill-tokens N makes every timed step a mixed one: beside the N decode rows, a new prompt of N tokens
less the batch is prefilled whole (one output token), so that the step carries N tokens in all (512: the
scheduler's default budget, a served step while requests arrive).

    .venv/bin/python bench/step_profile.py --batch-size 64
    .venv/bin/python bench/step_profile.py --batch-size 64 --prefill-tokens 512
    .venv/bin/python bench/step_profile.py --batch-size 64 --kv-cache-dtype fp8_e5m2
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


def prefilled_engine(
    model: str | None,
    batch_size: int,
    steps: int,
    batch_activations: str = "auto",
    kv_cache_dtype: str = "auto",
):
    # One sequence more than the batch: a mixed step's new prompt runs beside the batch, not after it.
    llm = LLM(
        model,
        max_num_seqs=batch_size + 1,
        enable_prefix_caching=False,
        batch_activations=batch_activations,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 50, ignore_eos=True)
    vocab_size = engine.runner.info.vocab_size
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randrange(100, vocab_size) for _ in range(128)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    return engine


def median_step_ms(engine, steps: int, prefill_tokens: int = 0) -> float:
    """The median step; with prefill_tokens, each step also prefills a new prompt up to that many tokens."""
    rng = random.Random(1)
    vocab_size = engine.runner.info.vocab_size
    prompt_len = prefill_tokens - len(engine.requests)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for _ in range(steps):
        if prefill_tokens:
            engine.add_request(
                f"p{time.perf_counter_ns()}",
                [rng.randrange(100, vocab_size) for _ in range(prompt_len)],
                params,
            )
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def kv_bytes_read(engine) -> int:
    """The K/V bytes a decode step's attention reads: each running sequence's context, every layer."""
    runner = engine.runner
    arch = runner.full_arch
    token_bytes = (
        runner.model.kv_cache_spec(arch).values_per_token() * runner.kv_cache_dtype.itemsize * arch.num_layers
    )
    return sum(r.num_computed_tokens + 1 for r in engine.requests.values()) * token_bytes


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
    parser.add_argument(
        "--prefill-tokens", type=int, default=0,
        help="tokens a step carries, decode rows and a new prompt's prefill together (0: decode steps)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-activations", default="auto", choices=["auto", "int8", "float32"], help="as serve's flag"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e5m2", "int8"],
        help="as serve's flag",
    )
    args = parser.parse_args()
    if args.prefill_tokens and args.prefill_tokens <= args.batch_size:
        parser.error("--prefill-tokens must exceed --batch-size (the decode rows)")
    engine = prefilled_engine(
        args.model, args.batch_size, args.steps, args.batch_activations, args.kv_cache_dtype
    )
    model = engine.runner.model
    fused_ms = median_step_ms(engine, args.steps, args.prefill_tokens)
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
    median_step_ms(engine, 2, args.prefill_tokens)  # warm-up of the layer path
    spans.clear(), flops.clear(), weight_bytes.clear(), forward.clear(), final_norm_done.clear()
    kv_bytes = kv_bytes_read(engine)
    layered_ms = median_step_ms(engine, args.steps, args.prefill_tokens)
    kv_bytes = (kv_bytes + kv_bytes_read(engine)) / 2  # a step's, on average (contexts grow a token a step)
    steps = args.steps
    info = engine.runner.info
    print(json.dumps({
        "bench": "step_profile", "batch_size": args.batch_size, "prefill_tokens": args.prefill_tokens,
        "kernels": info.kernel_variant, "amx_tiles": info.amx_tiles, "dtype": info.dtype, "batch_activations": info.batch_activations,
        "kv_cache_dtype": info.cache_dtype,
        # A mixed step never takes the fused decode path: both figures are then the layer path's.
        "fused_step_ms": round(fused_ms, 2), "layered_step_ms": round(layered_ms, 2),
    }))  # fmt: skip
    hidden_size = model.norm.weight.shape[0]
    sampling_rows = args.batch_size + (1 if args.prefill_tokens else 0)
    flops["lm head (after the final norm)"] = 2.0 * sampling_rows * info.vocab_size * hidden_size * steps
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
        if weight_bytes.get(part):
            line["weight_gb_s"] = round(weight_bytes[part] / seconds / 1e9, 1)
        if part.startswith("attention") and not args.prefill_tokens:
            line["kv_gb_s"] = round(kv_bytes * steps / seconds / 1e9, 1)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
