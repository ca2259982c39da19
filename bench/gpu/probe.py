"""serval on CUDA against transformers on the same random weights: one JSON line per result on stdout.

Run by bench/gpu/check.sh on a machine lent a GPU (bench/gpu/README.md); its parts also run on the CPU with a
tiny shape (`--device cpu --shapes tiny`), which is how it is tried without a GPU. Sections, each timed and
each reporting its own error without stopping the rest (`--only` picks):

- kernels: the Triton attention backend against SDPA on the device's tensors, fp32 and bf16;
- fidelity: greedy tokens of serval and transformers' generate on a tiny random Llama, fp32 and bf16, and
  whether serval's batched tokens equal its one-at-a-time ones;
- offline: output tokens/s of `LLM.generate` at each batch size (128-token prompts, 128 new tokens, EOS
  ignored), per shape (Llama-3.2-1B and Llama-3.1-8B layers over SmolLM2's 49152-token vocabulary);
- hf: the same for transformers' generate on the same weights;
- profile: one decode step's GPU-busy share (kernel time over wall time, from the torch profiler);
- eager: the first shape's offline runs at batch 1 and 64 without decode graphs (cuda_graph_max_batch=0);
- http: `serval serve` on the first shape, streamed chat at concurrency 1 and 64 (bench/serve.py).

The models are made here, not read from a hub: transformers' random init (a fixed seed, wider than its
default so that greedy choices are not near-ties), saved as a Hugging Face directory that both load, with
the tokenizer of a metadata-only GGUF (the default model's, carried by bench/gpu/prepare.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)  # bench/model_shapes.py

VOCAB = 49152  # SmolLM2's tokenizer, which every model here uses


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(length)] for _ in range(count)]


def hf_config(shape_name: str, dtype: torch.dtype):
    from model_shapes import SHAPES
    from transformers import LlamaConfig

    s = SHAPES[shape_name]
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim, rope_theta=s.rope_theta, tie_word_embeddings=s.tie_word_embeddings,
        max_position_embeddings=s.context_length, rms_norm_eps=s.rms_norm_eps, bos_token_id=1, eos_token_id=2,
        initializer_range=0.05, torch_dtype=dtype,
    )  # fmt: skip


def make_model(shape_name: str, dtype: torch.dtype, args) -> tuple[str, torch.nn.Module]:
    """A random Llama of the shape on the device, saved where serval reads it: (directory, the model)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    directory = os.path.join(args.work_dir, f"{shape_name}-{str(dtype).removeprefix('torch.')}")
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(hf_config(shape_name, dtype)).to(dtype).eval()
    with torch.no_grad():  # norms away from all-ones, as the tests' tiny models, so a wrong norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    gguf_dir, gguf_name = os.path.split(args.tokenizer_gguf)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(directory)
    return directory, model


def serval_llm(directory: str, dtype: str, args, **extra):
    from serval import LLM

    return LLM(
        model=directory, dtype=dtype, device=args.device, kv_cache_memory_bytes=args.kv_cache_bytes,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192, enable_prefix_caching=False, **extra,
    )  # fmt: skip


def describe(llm) -> dict:
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    return {
        "attention_backend": runner.attention_backend.name,
        "compute_dtype": str(runner.dtype).removeprefix("torch."),
        "graph_buckets_captured": None if graphs is None else sorted(graphs.replays),
        "graph_capture_error": None if graphs is None else graphs.capture_error,
    }


def kernels(args) -> None:
    """The Triton attention backend against SDPA on the device, in fp32 and bf16: decode-only, prefill and
    mixed steps over scattered blocks, with windows and sinks (tests/runner/test_triton_attention.py runs
    the same under the interpreter, fp32 only)."""
    from serval.runner.attention.backend import (
        StepAttention,
        StepLayout,
        padded_block_tables,
        paged_attention,
    )
    from serval.runner.attention.sdpa import SdpaBackend
    from serval.runner.attention.triton_paged import TritonPagedBackend

    steps = {"decode": [(1, 9), (1, 300), (1, 0), (1, 63)], "mixed": [(1, 9), (130, 0), (17, 40), (1, 200)]}
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    # NOTE: fp32 only off CUDA: Triton's interpreter computes tl.dot over bf16 as garbage (it has no bf16).
    dtypes = (torch.float32, torch.bfloat16) if args.device.startswith("cuda") else (torch.float32,)
    for dtype in dtypes:
        for step_name, step in steps.items():
            for window, with_sinks in ((0, False), (64, True)):
                generator = torch.Generator().manual_seed(0)
                blocks = [-(-(n + c) // block_size) for n, c in step]
                perm = torch.randperm(sum(blocks) + 4, generator=generator).tolist()
                tables = [perm[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(step))]
                total = sum(n for n, _ in step)
                cache = torch.randn(len(perm) * block_size, num_kv_heads, head_dim, generator=generator)
                q = torch.randn(total, num_heads, head_dim, generator=generator)
                kv = torch.randn(total, num_kv_heads, head_dim, generator=generator)
                sinks = torch.randn(num_heads, generator=generator).to(args.device) if with_sinks else None
                layout = StepLayout([n for n, _ in step], [c for _, c in step], padded_block_tables(tables),
                                    block_size, torch.device(args.device))  # fmt: skip
                outs = []
                for backend in (SdpaBackend(), TritonPagedBackend()):
                    k_cache, v_cache = (cache.to(args.device, dtype) for _ in range(2))
                    on = [t.to(args.device, dtype) for t in (q, kv, kv)]
                    attention = StepAttention.build(backend, layout)
                    outs.append(
                        paged_attention(*on, k_cache, v_cache, attention, head_dim**-0.5, window, sinks)
                    )
                emit(check="kernels", dtype=str(dtype), step=step_name, window=window, sinks=with_sinks,
                     max_abs_diff=float((outs[0].float() - outs[1].float()).abs().max()))  # fmt: skip


def fidelity(args) -> None:
    from serval import SamplingParams

    prompts = random_prompts(4, 24, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    directory, model = make_model(args.fidelity_shape, torch.float32, args)
    for dtype in ("float32", "bfloat16"):
        reference = model.to(getattr(torch, dtype))
        expected = []
        with torch.inference_mode():
            for prompt in prompts:
                x = torch.tensor([prompt], device=args.device)
                out = reference.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False, pad_token_id=0
                )
                expected.append(out[0, len(prompt) :].tolist())
        llm = serval_llm(directory, dtype, args)
        alone = [list(llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids) for p in prompts]
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        emit(
            check="fidelity", dtype=dtype, **describe(llm), of=32,
            tokens_equal_to_hf=[sum(a == b for a, b in zip(e, g)) for e, g in zip(expected, alone)],
            first_divergence=[next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), None)
                              for e, g in zip(expected, alone)],
            batched_equals_alone=[list(b.outputs[0].token_ids) == a for a, b in zip(alone, batched)],
        )  # fmt: skip
        del llm
        release(args.device)


def offline(llm, shape_name: str, args, started: float, batch_sizes=None, check="offline") -> None:
    from serval import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for batch in batch_sizes or args.batch_sizes:
        if time.perf_counter() - started > args.budget:
            emit(check=check, shape=shape_name, batch=batch, skipped="over the time budget")
            continue
        prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, args.prompt_tokens, seed=batch)]
        llm.generate(prompts, warm)  # compiles the kernels and captures this batch's graph bucket
        synchronize(args.device)
        t = time.perf_counter()
        outputs = llm.generate(prompts, params)
        synchronize(args.device)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        emit(check=check, shape=shape_name, batch=batch, out_tokens=tokens, seconds=round(seconds, 3),
             tok_s=round(tokens / seconds, 1), **describe(llm))  # fmt: skip


def hf_generate(model, shape_name: str, args, started: float) -> None:
    for batch in args.hf_batch_sizes:
        if time.perf_counter() - started > args.budget:
            emit(check="hf", shape=shape_name, batch=batch, skipped="over the time budget")
            continue
        x = torch.tensor(random_prompts(batch, args.prompt_tokens, seed=batch), device=args.device)
        mask = torch.ones_like(x)
        with torch.inference_mode():
            model.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
            synchronize(args.device)
            t = time.perf_counter()
            out = model.generate(
                x, attention_mask=mask, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            synchronize(args.device)
        seconds = time.perf_counter() - t
        tokens = (out.shape[1] - x.shape[1]) * batch
        emit(check="hf", shape=shape_name, batch=batch, out_tokens=tokens, seconds=round(seconds, 3),
             tok_s=round(tokens / seconds, 1))  # fmt: skip


def profile_decode(llm, shape_name: str, args) -> None:
    """GPU-busy share of decode steps (kernel time over wall time, torch profiler). The LLM's engine runs on
    its own thread, so steps are not profiled one by one: the same batch is generated with 1 and with 33 new
    tokens, and the difference is 32 decode steps with the prefill and the call's overhead taken out."""
    from torch.profiler import ProfilerActivity, profile

    from serval import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.profile_batch, args.prompt_tokens, 99)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    measured = {}
    for max_tokens in (1, 33):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params)  # warm: kernels compiled, the bucket's graph captured
        with profile(activities=activities) as prof:
            synchronize(args.device)
            t = time.perf_counter()
            llm.generate(prompts, params)
            synchronize(args.device)
            wall = time.perf_counter() - t
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        measured[max_tokens] = (wall, busy, sum(e.count for e in kernels))
        if max_tokens == 33:
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15), file=sys.stderr)
    (wall_1, busy_1, launches_1), (wall_33, busy_33, launches_33) = measured[1], measured[33]
    wall, busy = wall_33 - wall_1, busy_33 - busy_1
    emit(check="profile", shape=shape_name, batch=args.profile_batch, decode_steps=32,
         step_ms=round(1e3 * wall / 32, 3), gpu_busy_ms=round(1e3 * busy / 32, 3),
         gpu_busy_share=round(busy / wall, 3) if wall > 0 else None,
         kernel_launches_per_step=round((launches_33 - launches_1) / 32, 1), **describe(llm))  # fmt: skip


def http(directory: str, args) -> None:
    """`serval serve` on the model, then bench/serve.py's streamed chat at each concurrency."""
    port = 8011
    command = [
        sys.executable, "-m", "serval.cli", "serve", "--model", directory, "--device", args.device,
        "--port", str(port), "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
    ]  # fmt: skip
    with open(os.path.join(args.out_dir, "serve.log"), "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not wait_healthy(port, server, timeout=180):
                emit(check="http", error="the server did not come up (serve.log)")
                return
            bench = [sys.executable, os.path.join(BENCH, "serve.py"), "--url", f"http://127.0.0.1:{port}",
                     "--concurrency", args.http_concurrency, "--max-tokens", str(args.max_tokens)]  # fmt: skip
            done = subprocess.run(
                bench, check=False, capture_output=True, text=True, timeout=args.http_timeout
            )
            for line in done.stdout.splitlines():
                emit(check="http", **json.loads(line))
            if done.returncode:
                emit(check="http", error=done.stderr[-2000:])
        finally:
            server.terminate()
            server.wait(timeout=60)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def release(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_shape(shape_name: str, is_first: bool, args, started: float) -> None:
    """The shape's model made once: transformers' generate on it, then serval's offline runs, the profile, and
    (first shape only) the server."""
    sections = args.only
    directory, model = make_model(shape_name, torch.bfloat16, args)
    if "hf" in sections:
        section("hf", hf_generate, model, shape_name, args, started)
    del model
    release(args.device)
    if {"offline", "profile"} & sections:
        t = time.perf_counter()
        llm = serval_llm(directory, "bfloat16", args)
        emit(check="load", shape=shape_name, seconds=round(time.perf_counter() - t, 2),
             gpu_gb=round(torch.cuda.memory_allocated() / 1e9, 2) if args.device.startswith("cuda") else None)  # fmt: skip
        if "offline" in sections:
            section("offline", offline, llm, shape_name, args, started)
        if "profile" in sections:
            section("profile", profile_decode, llm, shape_name, args)
        del llm
        release(args.device)
    if "eager" in sections and is_first:  # the same without decode graphs: what they are worth
        eager = serval_llm(directory, "bfloat16", args, cuda_graph_max_batch=0)
        section("eager", offline, eager, shape_name, args, started, [1, 64], "eager")
        del eager
        release(args.device)
    if "http" in sections and is_first:
        section("http", http, directory, args)


def section(name: str, run, *run_args) -> None:
    t = time.perf_counter()
    try:
        run(*run_args)
    except Exception as e:  # noqa: BLE001 (one section's failure is a result; the others still run)
        traceback.print_exc()
        emit(check=name, error=repr(e)[:2000])
    emit(check=f"{name}_done", seconds=round(time.perf_counter() - t, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer-gguf", required=True, help="a GGUF holding the tokenizer (no weights needed)")
    p.add_argument("--work-dir", default="/tmp/serval-gpu-models")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp/serval-gpu-out"))
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--fidelity-shape", default="tiny")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--hf-batch-sizes", default="1,16,64,256")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--profile-batch", type=int, default=16)
    p.add_argument("--http-concurrency", default="1,64")
    p.add_argument("--http-timeout", type=float, default=120)
    p.add_argument("--kv-cache-bytes", type=int, default=16 << 30)
    p.add_argument("--budget", type=float, default=330, help="seconds after which timed runs are skipped")
    p.add_argument("--only", default="kernels,fidelity,offline,hf,profile,eager,http")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    args.only = set(args.only.split(","))
    os.makedirs(args.work_dir, exist_ok=True)
    os.makedirs(args.out_dir, exist_ok=True)
    started = time.perf_counter()
    is_cuda = args.device.startswith("cuda")
    emit(check="env", torch=torch.__version__, device=torch.cuda.get_device_name(0) if is_cuda else "cpu")
    if "kernels" in args.only:
        section("kernels", kernels, args)
    if "fidelity" in args.only:
        section("fidelity", fidelity, args)
    for i, shape_name in enumerate(args.shapes.split(",")):
        section(f"shape {shape_name}", run_shape, shape_name, i == 0, args, started)


if __name__ == "__main__":
    main()
