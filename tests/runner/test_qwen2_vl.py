"""Qwen2-VL against transformers on a tiny random-weight checkpoint that transformers wrote: logits within
1e-3 in fp32 and equal greedy tokens for one image, two images, image and text turns, and a video; the
engine's continuous batching, chunked prefill (an image's rows over several chunks), preemption, prefix
cache (the same image hits, another image with the same placeholder ids does not) and the lifetime of the
runner's per-request media state; bf16 near fp32.

Images are real PNGs decoded by serving's decoder and patchified by its processor (serving/media/qwen2_vl.py);
the oracle gets the same pixel_values and grids (its own image processor agrees: tests/serving/media)."""

from __future__ import annotations

import dataclasses
import gc
import io
import weakref

import numpy as np
import pytest
import torch

from serval.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from serval.engine.engine import Engine
from serval.runner.batch import Batch
from serval.runner.media import MediaInput
from serval.sampling import SamplingParams
from serval.serving.media.decode import DecodedVideo, decode_image
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import content_hash
from serval.serving.media.qwen2_vl import Qwen2VLProcessor
from tests.fixtures.tiny_vl import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

TEXT = [list(range(40, 52)), list(range(60, 67)), list(range(90, 110))]  # three stretches of "text" ids


@pytest.fixture(scope="module")
def vl(tiny_vl_factory):
    directory, reference = tiny_vl_factory(False)
    return directory, reference, Qwen2VLProcessor.from_model_dir(directory)


def make_engine(directory: str, block_size: int = 16, budget: int = 512, num_blocks: int = 128) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=directory, dtype="float32"),
            cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        )
    )


def image(processor: Qwen2VLProcessor, width: int, height: int, seed: int) -> MediaInput:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    buffer.seek(0)
    decoded = decode_image(buffer, None, processor.resize_bounds, MediaConfig(), "p")
    return processor.encoder_input(decoded, content_hash(MediaKind.IMAGE, decoded))


def video(processor: Qwen2VLProcessor, num_frames: int, seed: int) -> MediaInput:
    frames = np.random.default_rng(seed).integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)
    decoded = DecodedVideo(frames, tuple(k * 0.5 for k in range(num_frames)), num_frames * 0.5, "mp4")
    return processor.encoder_input(decoded, content_hash(MediaKind.VIDEO, decoded))


def prompt_of(*parts) -> tuple[list[int], tuple[MediaInput, ...]]:
    """Token lists and media items in order -> the prompt ids (each item's run between the vision markers)
    and the items at their offsets."""
    ids: list[int] = []
    items = []
    for part in parts:
        if isinstance(part, MediaInput):
            ids.append(VISION_START)
            items.append(dataclasses.replace(part, offset=len(ids)))
            ids.extend([VIDEO_PAD if part.is_video else IMAGE_PAD] * part.num_tokens)
            ids.append(VISION_END)
        else:
            ids.extend(part)
    return ids, tuple(items)


def oracle_inputs(ids: list[int], items: tuple[MediaInput, ...]) -> dict:
    input_ids = torch.tensor([ids])
    kwargs = {"input_ids": input_ids}
    kwargs["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int() + 2 * (input_ids == VIDEO_PAD).int()
    for is_video, values, grids in ((False, "pixel_values", "image_grid_thw"),
                                    (True, "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        chosen = [item for item in items if item.is_video == is_video]
        if chosen:
            kwargs[values] = torch.cat([item.pixel_values for item in chosen])
            kwargs[grids] = torch.tensor([item.grid for item in chosen])
    return kwargs


def serval_logits(engine: Engine, ids: list[int], items) -> torch.Tensor:
    prompt = engine.runner.prepare_media(ids, items, len(ids) + 8)
    num_blocks = -(-len(ids) // engine.runner.block_size)
    batch = Batch(ids, [len(ids)], [0], [list(range(num_blocks))], [0], [], media=[prompt])
    return engine.runner.compute_logits(batch)[0]


def greedy(engine: Engine, requests: list[tuple[list[int], tuple]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, (ids, items) in enumerate(requests):
        engine.add_request(str(i), ids, params, media=items)
        tokens[str(i)] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [tokens[str(i)] for i in range(len(requests))]


def oracle_greedy(reference, ids: list[int], items, max_tokens: int = 8, **extra) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            **oracle_inputs(ids, items), **extra, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def engine(vl):
    return make_engine(vl[0])


@pytest.fixture(scope="module")
def logits_engine(vl):
    """For serval_logits, which writes KV blocks behind the block manager's back: never used to schedule."""
    return make_engine(vl[0])


@pytest.fixture(scope="module")
def cases(vl):
    processor = vl[2]
    first, second = image(processor, 150, 100, seed=1), image(processor, 60, 90, seed=2)
    clip = video(processor, 4, seed=3)  # grid (2, 4, 6): 12 rows; time 0..1 within the 2 x 3 merged grid
    return {
        "one image": prompt_of(TEXT[0], first, TEXT[1]),
        "two images": prompt_of(TEXT[0], first, TEXT[1], second, TEXT[2]),
        "image and text turns": prompt_of(TEXT[0], first, TEXT[1], [2, 1], TEXT[2], [2, 1], TEXT[1]),
        "video": prompt_of(TEXT[0], clip, TEXT[1]),
    }


@pytest.mark.parametrize("case", ["one image", "two images", "image and text turns", "video"])
def test_logits_and_greedy_tokens_match_transformers(vl, engine, logits_engine, cases, case):
    _, reference, _ = vl
    ids, items = cases[case]
    with torch.no_grad():
        out = reference(**oracle_inputs(ids, items))
        positions, delta = reference.model.get_rope_index(
            torch.tensor([ids]), oracle_inputs(ids, items)["mm_token_type_ids"],
            oracle_inputs(ids, items).get("image_grid_thw"), oracle_inputs(ids, items).get("video_grid_thw"),
        )  # fmt: skip
    prompt = engine.runner.prepare_media(ids, items, len(ids) + 8)
    assert torch.equal(prompt.positions, positions[:, 0]) and prompt.position_delta == int(delta)
    ours = serval_logits(logits_engine, ids, items)
    assert (ours - out.logits[0, -1]).abs().max().item() < 1e-3
    assert greedy(engine, [(ids, items)])[0] == oracle_greedy(reference, ids, items)


def test_the_image_matters(logits_engine, cases):
    # A model that ignored its encoder rows would pass the tests above with equal text; not this one.
    ids, items = cases["one image"]
    other = dataclasses.replace(items[0], pixel_values=items[0].pixel_values.flip(0))
    difference = serval_logits(logits_engine, ids, items) - serval_logits(logits_engine, ids, (other,))
    assert difference.abs().max() > 1e-2


def test_text_continues_after_the_largest_position_of_a_long_video(vl, engine):
    # 6 frames over a 1 x 1 merged grid: times 0, 1, 2 at one spatial place. vision_end follows at the
    # largest position + 1 (NOTE: transformers 5.23 advances by the merged grid's larger side only, so there
    # vision_end would reuse the second frame's time; Qwen's reference and vLLM continue after the largest).
    frames = np.zeros((6, 28, 28, 3), np.uint8)
    decoded = DecodedVideo(frames, tuple(range(6)), 6.0, "mp4")
    clip = vl[2].encoder_input(decoded, b"v")
    ids, items = prompt_of([40, 41], clip, [42, 43])
    prompt = engine.runner.prepare_media(ids, items, len(ids) + 8)
    assert prompt.positions.tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 8],  # text, vision_start, t = 0 1 2, vision_end, text
        [0, 1, 2, 3, 3, 3, 6, 7, 8],
        [0, 1, 2, 3, 3, 3, 6, 7, 8],
    ]
    assert prompt.position_delta == 0


def test_a_media_request_batched_with_a_text_request_matches_each_alone(vl, cases):
    ids, items = cases["two images"]
    text = (TEXT[2] + TEXT[0], ())
    engine = make_engine(vl[0])
    alone = greedy(engine, [(ids, items)]) + greedy(engine, [text])
    engine = make_engine(vl[0])
    assert greedy(engine, [(ids, items), text]) == alone


def test_chunked_prefill_splits_an_image_over_steps(vl, cases):
    # 7 tokens a step: the first image's 20 rows take three chunks, a decode of the other request between.
    ids, items = cases["two images"]
    whole = greedy(make_engine(vl[0]), [(ids, items)])
    engine = make_engine(vl[0], block_size=4, budget=7)
    assert greedy(engine, [(ids, items), (TEXT[1], ())])[0] == whole[0]


def test_the_encoder_runs_once_per_step_for_every_request_s_items(vl, cases, monkeypatch):
    engine = make_engine(vl[0])
    calls = []
    encode = engine.runner.model.encode
    monkeypatch.setattr(
        engine.runner.model, "encode", lambda items: calls.append(len(items)) or encode(items)
    )
    one, two = cases["one image"], cases["two images"]
    greedy(engine, [one, two])
    assert calls == [3]  # one call in the first step: the first request's image and the second's two


def test_media_state_lives_with_its_request(vl, cases):
    engine = make_engine(vl[0], budget=16)
    ids, items = cases["one image"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("done", ids, params, media=items)
    engine.add_request("aborted", ids, params, media=items)
    done, aborted = engine.requests["done"].media_prompt, engine.requests["aborted"].media_prompt
    states = [weakref.ref(done), weakref.ref(aborted)]
    engine.step()  # 16 tokens of "done": into its image, whose rows are held until its run is computed
    assert list(done.encoded) == [0] and not aborted.encoded
    engine.abort_request("aborted")
    while not engine.requests["done"].num_output_tokens:
        engine.step()
    assert not done.encoded  # the prompt is computed: encoder rows dropped, positions kept for decoding
    del done, aborted
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()
    assert [state() for state in states] == [None, None]


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(vl):
    processor = vl[2]
    ids, items = prompt_of(TEXT[2], image(processor, 150, 100, seed=5), TEXT[1])  # the image from row 21
    other = (ids, (dataclasses.replace(items[0], **_fields(image(processor, 150, 100, seed=6))),))
    assert other[0] == ids  # the same placeholder ids
    engine = make_engine(vl[0])
    first = greedy(engine, [(ids, items)])
    again = greedy(engine, [(ids, items)])
    assert again == first and engine.requests == {}
    hits = engine.block_manager.num_hit_tokens
    assert hits == (len(ids) - 1) // 16 * 16  # every full block of the prompt
    different = greedy(engine, [other])
    assert engine.block_manager.num_hit_tokens - hits == 16  # only the text block before the image
    assert different == greedy(make_engine(vl[0]), [other]) != first


def _fields(item: MediaInput) -> dict:
    return {"content_hash": item.content_hash, "pixel_values": item.pixel_values}


def test_preempted_media_requests_recompute_and_encode_again(vl, cases):
    # 9 blocks of 16 hold both prompts (3 blocks each) but not both answers: the newer is preempted, its
    # blocks freed, and it recomputes its prompt later, encoding its images again.
    requests = [cases["two images"], cases["one image"]]
    alone = [greedy(make_engine(vl[0]), [request], max_tokens=40)[0] for request in requests]
    engine = make_engine(vl[0], num_blocks=9)
    assert greedy(engine, requests, max_tokens=40) == alone
    assert engine.num_preemptions > 0


def test_bf16_follows_fp32(vl, cases):
    ids, items = cases["two images"]
    fp32 = serval_logits(make_engine(vl[0]), ids, items)
    bf16 = Engine(
        EngineConfig(model=ModelConfig(model=vl[0], dtype="bfloat16"), cache=CacheConfig(num_blocks=16))
    )
    difference = (serval_logits(bf16, ids, items) - fp32).abs().max().item()
    assert difference < 0.05 * fp32.abs().max().item()


def test_the_tower_s_plain_pytorch_rotation_matches_the_native_kernel(vl, cases):
    from serval.runner.models.qwen2_vl_vision import VisionAttention

    engine = make_engine(vl[0])
    model, items = engine.runner.model, cases["two images"][1]
    attentions = [m for m in model.visual.modules() if isinstance(m, VisionAttention)]
    if attentions[0].native_rotary is None:
        pytest.skip("the native kernels are not built here")
    with torch.inference_mode():
        native = model.encode(items)
        for attention in attentions:
            attention.native_rotary = None
        plain = model.encode(items)
    assert (native - plain).abs().max().item() < 1e-5


BAD_ITEMS = {
    "run past the prompt": lambda item, ids: dataclasses.replace(item, offset=len(ids) - 3),
    "run over text": lambda item, ids: dataclasses.replace(item, offset=item.offset - 2),
    "video id for an image": lambda item, ids: dataclasses.replace(item, is_video=True),
    "rows for another grid": lambda item, ids: dataclasses.replace(item, grid=(1, 4, 12)),
    "odd grid": lambda item, ids: dataclasses.replace(item, grid=(1, 5, 16), num_tokens=20),
    "pixels of another shape": lambda item, ids: dataclasses.replace(
        item, pixel_values=item.pixel_values[:, :-1]
    ),
    "an image with frames": lambda item, ids: dataclasses.replace(item, grid=(2, 4, 10)),
}


@pytest.mark.parametrize("case", BAD_ITEMS)
def test_bad_media_items_are_refused_before_anything_is_added(engine, cases, case):
    ids, items = cases["one image"]
    bad = BAD_ITEMS[case](items[0], ids)
    params = SamplingParams(max_tokens=4)
    try:
        with pytest.raises(ValueError):
            engine.add_request("bad", ids, params, media=(bad,))
        assert not engine.has_unfinished_requests()
    finally:
        engine.abort_request("bad")


def test_a_text_only_model_refuses_media(tiny_model_factory, cases):
    directory, _ = tiny_model_factory("qwen2", False)
    engine = make_engine(directory)
    ids, items = cases["one image"]
    with pytest.raises(ValueError, match="does not take media"):
        engine.add_request("x", ids, SamplingParams(max_tokens=4), media=items)
