"""Qwen2.5-VL against transformers on a tiny random-weight checkpoint: the vision tower's windows (56-pixel
windows, so an image spans several, cut short at its edges) and full-attention blocks, RMSNorm and the gated
MLP, and a video's M-RoPE time spaced by tokens_per_second x seconds per temporal patch; logits within 1e-3
in fp32 and equal greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from serval.runner.loader.safetensors import read_hf_config
from serval.runner.models.arch import ArchConfig
from serval.runner.models.qwen2_vl_vision import window_order
from serval.sampling import SamplingParams
from serval.serving.media.decode import DecodedVideo
from serval.serving.media.parts import MediaKind
from serval.serving.media.processor import content_hash
from serval.serving.media.qwen2_vl import Qwen2VLProcessor
from tests.runner.test_qwen2_vl import (
    TEXT,
    greedy,
    image,
    make_engine,
    oracle_greedy,
    oracle_inputs,
    prompt_of,
    serval_logits,
)


@pytest.fixture(scope="module")
def vl(tiny_vl_factory):
    directory, reference = tiny_vl_factory(True)
    return directory, reference, Qwen2VLProcessor.from_model_dir(directory)


def slow_video(processor: Qwen2VLProcessor):
    # 4 frames sampled 0.5 s apart: 1 s a temporal patch, so time advances 2 (tokens_per_second) a patch.
    frames = np.random.default_rng(4).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    decoded = DecodedVideo(frames, (0.0, 0.5, 1.0, 1.5), 2.0, "mp4")
    return processor.encoder_input(decoded, content_hash(MediaKind.VIDEO, decoded))


def test_the_config_reads_as_qwen2_5(vl):
    vision = ArchConfig.from_hf_config(read_hf_config(vl[0])).vision
    assert vision.is_qwen2_5 and vision.fullatt_block_indexes == (1, 3) and vision.window_size == 56
    assert (vision.embed_dim, vision.out_hidden_size, vision.intermediate_size) == (32, 64, 48)


def test_windows_cover_every_patch_once(vl):
    vision = ArchConfig.from_hf_config(read_hf_config(vl[0])).vision
    order, bounds = window_order([(1, 8, 10), (2, 4, 4)], vision)  # 4 x 5 groups: windows of 2 x 2, 2 x 1
    assert sorted(order.tolist()) == list(range(80 + 32))
    assert bounds == [0, 16, 32, 40, 56, 72, 80, 96, 112]
    assert order[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and order[8:12].tolist() == [20, 21, 22, 23]


@pytest.mark.parametrize("case", ["image", "two images and a video"])
def test_logits_and_greedy_tokens_match_transformers(vl, case):
    directory, reference, processor = vl
    first = image(processor, 150, 100, seed=1)  # 8 x 10 patches: windows of 2 x 2 groups, the last cut
    if case == "image":
        ids, items = prompt_of(TEXT[0], first, TEXT[1])
    else:
        second = image(processor, 60, 90, seed=2)
        ids, items = prompt_of(TEXT[0], first, TEXT[1], slow_video(processor), second, TEXT[2])
    kwargs = oracle_inputs(ids, items)
    videos = [item for item in items if item.is_video]
    if videos:
        kwargs["second_per_grid_ts"] = torch.tensor([item.seconds_per_grid for item in videos])
    engine = make_engine(directory)
    with torch.no_grad():
        theirs = reference(**kwargs).logits[0, -1]
        positions, _ = reference.model.get_rope_index(
            kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs.get("image_grid_thw"),
            kwargs.get("video_grid_thw"), kwargs.get("second_per_grid_ts"),
        )  # fmt: skip
    assert torch.equal(engine.runner.prepare_media(ids, items, len(ids) + 8).positions, positions[:, 0])
    assert (serval_logits(engine, ids, items) - theirs).abs().max().item() < 1e-3
    engine = make_engine(directory)
    extra = {"second_per_grid_ts": kwargs["second_per_grid_ts"]} if videos else {}
    assert greedy(engine, [(ids, items)])[0] == oracle_greedy(reference, ids, items, **extra)


def test_video_time_past_the_rotary_tables_is_refused(vl):
    clip = slow_video(vl[2])
    ids, items = prompt_of(TEXT[0], dataclasses.replace(clip, seconds_per_grid=600.0), TEXT[1])
    engine = make_engine(vl[0])
    with pytest.raises(ValueError, match="positions run to 1"):  # time 1200 a patch: past the 1024 held
        engine.add_request("far", ids, SamplingParams(max_tokens=4), media=items)
    assert not engine.has_unfinished_requests()
    near = (dataclasses.replace(items[0], seconds_per_grid=1.0),)  # the same video sampled at 2 fps
    engine.add_request("near", ids, SamplingParams(max_tokens=4), media=near)
    assert engine.has_unfinished_requests()
