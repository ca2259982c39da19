"""Engine decode-step latency at fixed batch sizes, with the native decode paths switched on and off.

For each batch size: that many requests with distinct random 128-token prompts are prefilled, then every
variant times `--steps` decode steps in turn (engine.step(): schedule, run, sample, update), round robin so
that drift on a shared machine hits all of them alike. One JSON line per (batch size, variant): median and
10th percentile in ms, tokens/s at the median, and the step's host time: the median of (step - the model's
forward pass), i.e. scheduling, batch building, attention metadata, sampling and updating the requests.

Variants, all in one process on the same weights:
  layers          the Python decoder layers (native norm/RoPE/attention/small-matmul kernels)
  stack           + DecodeStack: every layer of a decode-only step in one native call
  stack+packed    + the exact 4/8-bit packed weights (the default; up to 8 rows on avx512, every batch
                  size elsewhere, where the dense copies are freed at load and the other two variants
                  cannot run)
  torch-dense     stack+packed with the dense (unpacked) matrices through PyTorch's GEMM and the bf16
                  small-batch kernel, as before kernels.dense_linear (whose order over K does not follow the
                  row count): its cost on a safetensors checkpoint (`--variants stack+packed,torch-dense`;
                  stack+packed then runs every dense matrix through dense_linear, as --deterministic does)

    .venv/bin/python bench/decode_step.py --batch-sizes 1,8,16,64
    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_step.py --batch-sizes 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from tqdm import tqdm


def set_packed(model, packed: dict, on: bool) -> None:
    """Switch the quantized kernels of the packed Linear layers (and the tied head) on or off."""
    for module, kernel in packed.items():
        if module is model:
            model.tied_head_quantized_kernel = kernel if on else None
        else:
            module.quantized_kernel = kernel if on else None


def build_variants(runner) -> tuple[dict[str, tuple], dict]:
    """({variant: (decode stack or None, packed weights on)}, {module: its quantized kernel})."""
    from serval.runner.kernels import load_cpu_kernels
    from serval.runner.layers import Linear
    from serval.runner.models.decode_stack import make_decode_stack
    from serval.runner.quantization import is_placeholder

    model = runner.model
    packed = {m: m.quantized_kernel for m in model.modules() if isinstance(m, Linear) and m.quantized_kernel}
    if getattr(model, "tied_head_quantized_kernel", None) is not None:
        packed[model] = model.tied_head_quantized_kernel
    full_stack = model.decode_stack
    if any(is_placeholder(m.weight) for m in packed if isinstance(m, Linear)):
        # The packed kernels serve every batch size here, so the dense copies were freed at load: there is
        # nothing to compare the packed path with.
        return {"stack+packed": (full_stack, True)}, packed
    plain_stack = None
    if full_stack is not None:
        set_packed(model, packed, False)  # a stack built now holds no packed forms
        int8 = runner.batch_activations == "int8"
        plain_stack = make_decode_stack(model, load_cpu_kernels(), runner.kv_caches, runner.block_size, int8)
        set_packed(model, packed, True)
    variants = {"layers": (None, False), "stack": (plain_stack, False), "stack+packed": (full_stack, True)}
    return variants, packed


def set_invariant_dense(runner, on: bool) -> None:
    """Dense matrices through kernels.dense_linear (on: every dtype, as --deterministic does) or PyTorch's
    GEMM; rebuilds the stack."""
    from serval.runner.kernels import load_cpu_kernels
    from serval.runner.layers import use_native_kernels

    kernels, int8 = load_cpu_kernels(), runner.batch_activations == "int8"
    use_native_kernels(runner.model, kernels, int8, deterministic=True, invariant_dense=on)
    runner.model.use_kernels(
        kernels,
        runner.kv_caches,
        runner.block_size,
        runner.dtype,
        int8,
        deterministic=True,
        invariant_dense=on,
    )


def use_variant(runner, variants: dict[str, tuple], packed: dict, variant: str) -> None:
    if "torch-dense" in variants:
        set_invariant_dense(runner, variant != "torch-dense")
    stack, packed_on = variants["stack+packed" if variant == "torch-dense" else variant]
    if variant != "torch-dense":
        runner.model.decode_stack = stack
    set_packed(runner.model, packed, packed_on)


def time_forward_passes(model) -> list[float]:
    """A list that collects the seconds of each forward pass of the model from now on."""
    durations: list[float] = []
    started: list[float] = []
    model.register_forward_pre_hook(lambda module, args: started.append(time.perf_counter()))
    model.register_forward_hook(
        lambda module, args, out: durations.append(time.perf_counter() - started.pop())
    )
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", default="1,8,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="layers,stack,stack+packed")
    parser.add_argument(
        "--batch-activations",
        default="auto",
        choices=["auto", "int8", "float32"],
        help="as serve's flag (auto: int8 wherever AVX2 is, int16 x in the portable build)",
    )
    parser.add_argument(
        "--as-cpu-without-bf16",
        action="store_true",
        help="fp32 compute over the packed weights, as on a CPU without native bf16 (with SERVAL_KERNEL_VARIANT"
        "=avx2: an AVX2 machine's decode step, on this one's cores)",
    )
    args = parser.parse_args()
    if args.as_cpu_without_bf16:
        from serval.runner import placement

        # what resolve_dtype asks; the kernels stay as they are
        placement.cpu_has_native_bf16 = lambda: False

    from serval import LLM, SamplingParams

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    variants = args.variants.split(",")
    llm = LLM(
        model=args.model,
        max_num_seqs=max(batch_sizes),
        enable_prefix_caching=False,
        batch_activations=args.batch_activations,
    )
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    available, packed = build_variants(runner)
    if "torch-dense" in variants:
        available["torch-dense"] = available["stack+packed"]
    unavailable = [v for v in variants if v not in available]
    if unavailable:
        print(f"skipping {', '.join(unavailable)}: the dense weights were freed at load", file=sys.stderr)
        variants = [v for v in variants if v in available]
    rng = random.Random(0)
    vocab_size = runner.info.vocab_size
    total_steps = len(variants) * args.rounds * (args.steps + 2)
    params = SamplingParams(temperature=0.0, max_tokens=total_steps + 8, ignore_eos=True)
    forward = time_forward_passes(model)
    for batch_size in tqdm(batch_sizes, desc="batch sizes", disable=None, file=sys.stderr):
        for i in range(batch_size):
            prompt = [rng.randrange(100, vocab_size) for _ in range(args.prompt_len)]
            engine.add_request(f"b{batch_size}-{i}", prompt, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
        times: dict[str, list[float]] = {v: [] for v in variants}
        host_times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                use_variant(runner, available, packed, variant)
                engine.step()
                engine.step()  # warm-up after a switch
                for _ in range(args.steps):
                    forward.clear()
                    started = time.perf_counter()
                    engine.step()
                    times[variant].append(time.perf_counter() - started)
                    host_times[variant].append(times[variant][-1] - sum(forward))
        use_variant(runner, available, packed, "stack+packed")
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        for variant, samples in times.items():
            samples.sort()
            median = statistics.median(samples)
            print(json.dumps({
                "bench": "decode_step", "batch_size": batch_size, "variant": variant,
                "threads": runner.num_threads, "dtype": runner.info.dtype,
                "kernels": runner.info.kernel_variant, "amx_tiles": runner.info.amx_tiles, "batch_activations": runner.info.batch_activations,
                "median_ms": round(median * 1e3, 2), "p10_ms": round(samples[len(samples) // 10] * 1e3, 2),
                "tokens_per_s": round(batch_size / median, 1),
                "host_median_ms": round(statistics.median(host_times[variant]) * 1e3, 3),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
