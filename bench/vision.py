"""Image requests: time to first token and images/s for 448x448 images on a random Qwen2-VL of real width.

Four steps, each printing JSON lines on stdout:

    # A Qwen2-VL-2B-wide checkpoint, shrunk in depth (4 decoder layers, 4 ViT blocks), random weights,
    # with the tiny test tokenizer (its vision tokens) and Qwen2-VL's preprocessor_config.json:
    .venv/bin/python bench/vision.py make --out /tmp/serval-models/qwen2-vl-wide
    # serval's and transformers' vision towers on the same weights, 1 and 8 images a call:
    .venv/bin/python bench/vision.py encoder --model /tmp/serval-models/qwen2-vl-wide
    # transformers' generate of one token (its time to first token) for 1 and 8 requests at once:
    .venv/bin/python bench/vision.py hf --model /tmp/serval-models/qwen2-vl-wide
    # a running server: C requests in flight, each one 448x448 PNG (distinct pixels: no prefix-cache hit)
    # asking for one token, so a request's latency is its time to first token:
    .venv/bin/serval serve --model /tmp/serval-models/qwen2-vl-wide --port 8000 &
    .venv/bin/python bench/vision.py serve --url http://127.0.0.1:8000 --concurrency 1,8

images/s in `serve` is requests finished per second of the level (one image each): encoder, prefill and
HTTP together; `encoder` isolates the vision tower.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import time

import numpy as np

SIDE = 448  # pixels: 32 x 32 patches, 256 merged tokens


def png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def make(args) -> None:
    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.fixtures.tiny_vl import IDS, write_preprocessor_config, write_vl_tokenizer

    text = {
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": args.layers, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "rms_norm_eps": 1e-6, "bos_token_id": IDS["<|im_start|>"], "eos_token_id": IDS["<|im_end|>"],
    }  # fmt: skip
    vision = {
        "depth": args.vision_depth, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 1536,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }  # fmt: skip
    config = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
        vision_start_token_id=IDS["<|vision_start|>"], vision_end_token_id=IDS["<|vision_end|>"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    write_vl_tokenizer(args.out)
    write_preprocessor_config(args.out)
    with open(os.path.join(args.out, "preprocessor_config.json")) as f:
        pre = json.load(f)
    pre["max_pixels"] = 28 * 28 * 1280  # Qwen2-VL's own bound: a 448x448 image stays 448x448
    with open(os.path.join(args.out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f)
    print(json.dumps({"made": args.out}))


def _images(processor, count: int, seed: int):
    from serval.serving.media.decode import decode_image
    from serval.serving.media.limits import MediaConfig
    from serval.serving.media.parts import MediaKind
    from serval.serving.media.processor import content_hash

    items = []
    for k in range(count):
        decoded = decode_image(io.BytesIO(png(seed + k)), None, processor.resize_bounds, MediaConfig(), "p")
        items.append(processor.encoder_input(decoded, content_hash(MediaKind.IMAGE, decoded)))
    return items


def _time(call, repeats: int) -> float:
    call()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats


def encoder(args) -> None:
    import torch
    import transformers

    from serval.config import CacheConfig, EngineConfig, ModelConfig
    from serval.engine.engine import Engine
    from serval.serving.media.qwen2_vl import Qwen2VLProcessor

    processor = Qwen2VLProcessor.from_model_dir(args.model)
    engine = Engine(
        EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype), cache=CacheConfig(num_blocks=64))
    )
    dtype = engine.runner.dtype
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(args.model, dtype=dtype).eval()
    for batch in (1, 8):
        items = _images(processor, batch, seed=100 * batch)
        pixel_values = torch.cat([item.pixel_values for item in items]).to(dtype)
        grid = torch.tensor([item.grid for item in items])
        with torch.inference_mode():
            ours = _time(lambda items=items: engine.runner.model.encode(items), args.repeats)
            theirs = _time(lambda x=pixel_values, grid=grid: hf.model.visual(x, grid_thw=grid), args.repeats)
        for name, seconds in (("serval", ours), ("hf-transformers", theirs)):
            print(json.dumps({"bench": "encoder", "engine": name, "dtype": str(dtype).removeprefix("torch."),
                              "images_per_call": batch, "seconds_per_call": round(seconds, 3),
                              "images_per_s": round(batch / seconds, 2)}), flush=True)  # fmt: skip


def hf(args) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer

    from serval.serving.media.qwen2_vl import Qwen2VLProcessor

    processor = Qwen2VLProcessor.from_model_dir(args.model)
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(args.model, dtype=dtype).eval()
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    c = processor.config
    for batch in (1, 8):
        items = _images(processor, batch, seed=1000 * batch)
        head = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False).ids
        tail = tokenizer.encode("Describe this image.<|im_end|>\n<|im_start|>assistant\n").ids
        ids = [
            head
            + [c.vision_start_token_id, *[c.image_token_id] * items[0].num_tokens, c.vision_end_token_id]
            + tail
        ]
        input_ids = torch.tensor(ids * batch)
        kwargs = {
            "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": torch.cat([item.pixel_values for item in items]).to(dtype),
            "image_grid_thw": torch.tensor([item.grid for item in items]),
            "mm_token_type_ids": (input_ids == c.image_token_id).int(),
        }  # fmt: skip
        with torch.inference_mode():
            seconds = _time(
                lambda kwargs=kwargs: model.generate(
                    **kwargs, max_new_tokens=1, do_sample=False, pad_token_id=0
                ),
                1,
            )
        row = {
            "bench": "ttft",
            "engine": "hf-transformers",
            "dtype": str(dtype).removeprefix("torch."),
            "concurrency": batch,
            "ttft_ms": round(seconds * 1000),
            "images_per_s": round(batch / seconds, 2),
        }
        print(json.dumps(row), flush=True)


async def _level(args, concurrency: int) -> dict:
    import httpx

    latencies: list[float] = []
    errors: list[str] = []
    next_seed = iter(range(10_000 * concurrency, 10_000 * concurrency + 10_000))

    async def worker(client) -> None:
        while len(latencies) + len(errors) < args.num_requests:
            url = "data:image/png;base64," + base64.b64encode(png(next(next_seed))).decode()
            body = {
                "model": args.model_name, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "Describe this image."}]}],
            }  # fmt: skip
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=body)
            if response.status_code == 200:
                latencies.append(time.perf_counter() - started)
            else:
                errors.append(response.text[:200])

    async with httpx.AsyncClient(base_url=args.url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ms = sorted(x * 1000 for x in latencies)
    return {
        "bench": "ttft", "engine": "serval", "concurrency": concurrency, "requests": len(ms),
        "errors": len(errors), "ttft_ms_mean": round(statistics.fmean(ms)) if ms else None,
        "ttft_ms_p50": round(ms[len(ms) // 2]) if ms else None, "ttft_ms_max": round(ms[-1]) if ms else None,
        "images_per_s": round(len(ms) / elapsed, 2), "first_error": errors[0] if errors else None,
    }  # fmt: skip


def serve(args) -> None:
    import httpx

    if args.model_name is None:
        args.model_name = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        print(json.dumps(asyncio.run(_level(args, concurrency))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make")
    p.add_argument("--out", default="/tmp/serval-models/qwen2-vl-wide")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vision-depth", type=int, default=4)
    for name in ("encoder", "hf"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="/tmp/serval-models/qwen2-vl-wide")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--repeats", type=int, default=3)
    p = sub.add_parser("serve")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model-name", default=None)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-requests", type=int, default=16)
    args = parser.parse_args()
    {"make": make, "encoder": encoder, "hf": hf, "serve": serve}[args.command](args)


if __name__ == "__main__":
    main()
