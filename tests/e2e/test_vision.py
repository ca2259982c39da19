"""A tiny Qwen2-VL checkpoint (written by transformers) served by the real `serval serve` on loopback and
asked through the real openai client: an image as a data: URL of a PNG made with Pillow, and an MP4 made
with PyAV, are counted in usage.prompt_tokens_details and answered token for token as transformers' greedy
generate answers the same prompt and pixels; bad media are 400s in the OpenAI error shape."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch

from serval.serving.media.decode import decode_image, decode_video
from serval.serving.media.limits import MediaConfig
from serval.serving.media.processor import read_resize_bounds
from serval.serving.media.qwen2_vl import Qwen2VLProcessor
from tests.e2e.conftest import running_server
from tests.fixtures.tiny_vl import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START
from tests.serving.media.files import video_bytes

pytestmark = pytest.mark.slow

QUESTION = "what is in this picture"
MAX_TOKENS = 8


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vl_server(tiny_vl_factory, tmp_path_factory):
    directory, reference = tiny_vl_factory(False)
    log = tmp_path_factory.mktemp("vl-server") / "server.log"
    args = [
        "--model",
        directory,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--log-level",
        "warning",
    ]
    with running_server(args, log) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, directory, reference


def ask(client, *parts):
    content = [*parts, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True,
    )  # fmt: skip


def answer_bytes(answer) -> list[bytes]:
    """The answer's tokens as their bytes (a random tiny model's text is mostly partial characters)."""
    return [bytes(entry.bytes) for entry in answer.choices[0].logprobs.content]


def oracle_answer(directory: str, reference, png: bytes) -> tuple[int, int, str, list[bytes]]:
    """transformers' greedy answer to an image and the question, as serval renders the prompt: (prompt tokens,
    image tokens, text, the tokens' bytes). Its pixel values come from transformers' own image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = decode_image(io.BytesIO(png), None, read_resize_bounds(directory), MediaConfig(), "p").pixels
    features = Qwen2VLImageProcessorPil()(images=[pixels], do_resize=False, return_tensors="pt")
    num_pads = int(features["image_grid_thw"].prod()) // 4
    return generate(directory, reference, IMAGE_PAD, num_pads, **features)


def generate(
    directory: str, reference, pad: int, num_pads: int, **features
) -> tuple[int, int, str, list[bytes]]:
    from tokenizers import Tokenizer

    from serval.model_source import resolve_model
    from serval.serving.tokenizer import Tokenizer as ServalTokenizer

    tokenizer = Tokenizer.from_file(f"{directory}/tokenizer.json")
    # The template's text around the message, the item's run first in it, then the user's text.
    ids = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False).ids
    ids += [VISION_START, *[pad] * num_pads, VISION_END]
    ids += tokenizer.encode(QUESTION, add_special_tokens=False).ids
    ids += tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    input_ids = torch.tensor([ids])
    kind = 1 if pad == IMAGE_PAD else 2
    with torch.no_grad():
        out = reference.generate(
            input_ids=input_ids, mm_token_type_ids=kind * (input_ids == pad).int(), **features,
            max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            eos_token_id=reference.config.text_config.eos_token_id,
        )  # fmt: skip
    generated = out[0, len(ids) :].tolist()
    token_bytes = ServalTokenizer.from_source(resolve_model(directory)).token_bytes
    text = tokenizer.decode(generated, skip_special_tokens=True)
    return len(ids), num_pads + 2, text, [token_bytes(i) for i in generated]


def test_an_image_is_counted_and_answered_as_transformers_answers(vl_server):
    client, directory, reference = vl_server
    png = png_bytes(150, 100, seed=7)
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    answer = ask(client, {"type": "image_url", "image_url": {"url": url}})
    num_prompt, num_image, text, tokens = oracle_answer(directory, reference, png)
    details = answer.usage.prompt_tokens_details.model_dump()
    assert (answer.usage.prompt_tokens, details["image_tokens"]) == (num_prompt, num_image)
    assert details["text_tokens"] == num_prompt - num_image
    assert answer_bytes(answer) == tokens and answer.choices[0].message.content == text
    # Asked again: the same answer, the image's blocks from the prefix cache.
    again = ask(client, {"type": "image_url", "image_url": {"url": url}})
    assert answer_bytes(again) == tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    # Another image of the same size: other pixels, another answer from the same placeholder ids.
    other = png_bytes(150, 100, seed=8)
    url = f"data:image/png;base64,{base64.b64encode(other).decode()}"
    other_tokens = oracle_answer(directory, reference, other)[3]
    assert other_tokens != tokens
    assert answer_bytes(ask(client, {"type": "image_url", "image_url": url})) == other_tokens


def test_a_video_is_counted_and_answered_as_transformers_answers(vl_server):
    # 2 s of 64 x 48 at 10 fps, sampled at 2 fps: 4 frames of 56 x 56, 2 frame pairs of 2 x 2 merged patches.
    # transformers' video processor needs torchvision, so the oracle's pixels are serval's decoding and
    # patches (checked against the frames they cut in tests/serving/media/test_qwen2_vl_processor.py).
    client, directory, reference = vl_server
    clip = video_bytes(2.0, fps=10)
    answer = ask(client, {"type": "video_url", "video_url": {"url": data_url("video/mp4", clip)}, "fps": 2})
    processor = Qwen2VLProcessor.from_model_dir(directory)
    decoded = decode_video(io.BytesIO(clip), None, 2.0, processor.resize_bounds, None, MediaConfig(), "p")
    prepared = processor.encoder_input(decoded, b"")
    assert prepared.grid == (2, 4, 4)
    num_prompt, num_video, text, tokens = generate(
        directory, reference, VIDEO_PAD, prepared.num_tokens,
        pixel_values_videos=prepared.pixel_values, video_grid_thw=torch.tensor([prepared.grid]),
    )  # fmt: skip
    details = answer.usage.prompt_tokens_details.model_dump()
    assert (answer.usage.prompt_tokens, details["video_tokens"], details["image_tokens"]) == (
        num_prompt, num_video, 0,
    )  # fmt: skip
    assert num_video == 10 and answer_bytes(answer) == tokens and answer.choices[0].message.content == text


@pytest.mark.parametrize(
    "part, code",
    [
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "unsupported_media"),
        ({"type": "image_url", "image_url": data_url("image/png", b"\x89PNG\r\n\x1a\nxx")}, "invalid_media"),
        ({"type": "image_url", "image_url": data_url("image/jpeg", png_bytes(28, 28, 0))}, "invalid_media"),
    ],
)  # fmt: skip
def test_bad_media_are_400s_naming_the_part(vl_server, part, code):
    client = vl_server[0]
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, part)
    body = error.value.body
    assert body["param"] == "messages[0].content[0]" and body["code"] == code
    assert body["type"] == "invalid_request_error" and body["message"]


# Qwen2-VL's released chat template, in its parts that matter here: list content written item by item, an
# image as its vision markers around one pad (transformers' processor expands it), a default system turn.
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_images_sit_between_the_texts_as_transformers_processor_puts_them(vl_server):
    # /tokenize counts each image's run where the content list has it: the ids transformers makes of
    # Qwen2-VL's own template over the same list and pixels.
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    client, directory, _ = vl_server
    first, second = png_bytes(150, 100, seed=11), png_bytes(60, 90, seed=12)
    content = [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": data_url("image/png", first)}},
        {"type": "text", "text": "describe the image"},
        {"type": "image_url", "image_url": {"url": data_url("image/png", second)}},
    ]
    messages = [{"role": "system", "content": "describe the image"}, {"role": "user", "content": content}]
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    ours = httpx.post(f"{base_url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=60).json()

    # transformers renders the template and tokenizes; each pad is expanded to its image's merged patches as
    # Qwen2VLProcessor does (its class needs torchvision, for video, so its step is written out here).
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = tokenizer.apply_chat_template(
        messages, chat_template=QWEN2_VL_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    bounds = read_resize_bounds(directory)
    pixels = [
        decode_image(io.BytesIO(png), None, bounds, MediaConfig(), "p").pixels for png in (first, second)
    ]
    grids = Qwen2VLImageProcessorPil()(images=pixels, do_resize=False, return_tensors="pt")["image_grid_thw"]
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0] + "".join(
        "<|image_pad|>" * (int(g.prod()) // 4) + p for g, p in zip(grids, pieces[1:])
    )
    theirs = tokenizer(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    assert ours["tokens"] == theirs.tolist()
    assert ours["tokens"].count(IMAGE_PAD) == 20 + 6  # 140 x 112 and 56 x 84 pixels


def test_the_offline_llm_answers_images_as_the_server_does(vl_server):
    # vLLM's two shapes: chat with an image_url part, and a raw prompt with multi_modal_data's PIL images.
    from PIL import Image

    from serval import LLM, SamplingParams

    client, directory, _ = vl_server
    first, second = png_bytes(150, 100, seed=13), png_bytes(60, 90, seed=14)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url("image/png", png)}} for png in (first, second)
    ]
    served = ask(client, *parts)
    llm = LLM(model=directory, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat = llm.chat([{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}], params)[0]
    assert chat.outputs[0].text == served.choices[0].message.content
    assert (chat.usage.num_prompt_tokens, chat.usage.num_image_tokens) == (
        served.usage.prompt_tokens, served.usage.prompt_tokens_details.image_tokens,
    )  # fmt: skip
    run = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"<|im_start|>user\n{run}{run}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    images = [Image.open(io.BytesIO(png)) for png in (first, second)]
    raw = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)[0]
    assert (
        raw.prompt_token_ids == chat.prompt_token_ids
        and raw.outputs[0].token_ids == chat.outputs[0].token_ids
    )
