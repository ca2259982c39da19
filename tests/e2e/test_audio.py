"""A tiny Qwen2-Audio checkpoint (written by transformers) served by the real `serval serve` on loopback and
asked through the real openai client: a clip as `input_audio` (base64 WAV) and as `audio_url` (a data: URL of
FLAC or MP3) is counted in usage.prompt_tokens_details.audio_tokens and answered token for token as
transformers' greedy generate answers the same prompt, whose features and placeholder run come from
transformers' own Qwen2AudioProcessor; audio and text-only requests sent together answer as each alone; bad
parts are 400s in the OpenAI error shape naming the part."""

from __future__ import annotations

import base64
import concurrent.futures
import io

import httpx
import openai
import pytest
import torch

from serval.serving.media.decode import decode_audio
from serval.serving.media.limits import MediaConfig
from tests.e2e.conftest import running_server
from tests.fixtures.tiny_audio import AUDIO_PAD, SAMPLE_RATE, clip, encode_audio

pytestmark = pytest.mark.slow

QUESTION = "what is in this picture"  # words the tiny tokenizer knows
MAX_TOKENS = 8
MIMES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}


@pytest.fixture(scope="module")
def audio_server(tiny_audio_factory, tmp_path_factory):
    directory, reference = tiny_audio_factory()
    log = tmp_path_factory.mktemp("audio-server") / "server.log"
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


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url(data: bytes, fmt: str) -> dict:
    url = f"data:{MIMES[fmt]};base64,{base64.b64encode(data).decode()}"
    return {"type": "audio_url", "audio_url": {"url": url}}


def ask(client, *parts, text: str = QUESTION):
    content = [*parts, {"type": "text", "text": text}]
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True,
    )  # fmt: skip


def answer_bytes(answer) -> list[bytes]:
    """The answer's tokens as their bytes (a random tiny model's text is mostly partial characters)."""
    return [bytes(entry.bytes) for entry in answer.choices[0].logprobs.content]


def oracle_inputs(directory: str, data: bytes, fmt: str):
    """transformers' Qwen2AudioProcessor's inputs for a clip and the question, as serval renders the prompt
    (the clip's run first in the message). The samples are serval's decoding of the file; the features and
    the run's length are transformers'."""
    from transformers import AutoProcessor

    samples = decode_audio(io.BytesIO(data), fmt, MediaConfig(), "p").samples
    prompt = (
        f"<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    processor = AutoProcessor.from_pretrained(directory)
    return processor, processor(text=prompt, audio=[samples], sampling_rate=SAMPLE_RATE, return_tensors="pt")


def oracle_answer(directory: str, reference, data: bytes, fmt: str) -> tuple[int, int, str, list[bytes]]:
    """transformers' greedy answer (oracle_inputs): (prompt tokens, audio tokens, text, the tokens' bytes)."""
    from serval.model_source import resolve_model
    from serval.serving.tokenizer import Tokenizer as ServalTokenizer

    processor, inputs = oracle_inputs(directory, data, fmt)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            eos_token_id=reference.config.text_config.eos_token_id,
        )  # fmt: skip
    generated = out[0, len(ids) :].tolist()
    token_bytes = ServalTokenizer.from_source(resolve_model(directory)).token_bytes
    text = processor.tokenizer.decode(generated, skip_special_tokens=True)
    return len(ids), ids.count(AUDIO_PAD) + 2, text, [token_bytes(i) for i in generated]


@pytest.mark.parametrize(
    "fmt, spelling", [("wav", "input_audio"), ("flac", "audio_url"), ("mp3", "audio_url")]
)
def test_a_clip_is_counted_and_answered_as_transformers_answers(audio_server, fmt, spelling):
    client, directory, reference = audio_server
    data = encode_audio(clip(1.3, seed=7), fmt)
    part = input_audio(data, fmt) if spelling == "input_audio" else audio_url(data, fmt)
    answer = ask(client, part)
    num_prompt, num_audio, text, tokens = oracle_answer(directory, reference, data, fmt)
    details = answer.usage.prompt_tokens_details.model_dump()
    assert (answer.usage.prompt_tokens, details["audio_tokens"], details["image_tokens"]) == (
        num_prompt,
        num_audio,
        0,
    )
    assert details["text_tokens"] == num_prompt - num_audio
    assert answer_bytes(answer) == tokens and answer.choices[0].message.content == text
    if fmt == "wav":  # asked again: the same answer, the clip's blocks from the prefix cache
        again = ask(client, part)
        assert answer_bytes(again) == tokens and again.usage.prompt_tokens_details.cached_tokens >= 16


def test_tokenize_counts_the_clip_s_run_as_transformers_processor_writes_it(audio_server):
    client, directory, _ = audio_server
    data = encode_audio(clip(0.9, seed=10), "wav")
    content = [input_audio(data), {"type": "text", "text": QUESTION}]
    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    tokens = httpx.post(f"{base_url}/tokenize", json=body, timeout=60).json()
    assert tokens["tokens"] == oracle_inputs(directory, data, "wav")[1]["input_ids"][0].tolist()
    assert tokens["count"] == ask(client, input_audio(data)).usage.prompt_tokens


def test_audio_and_text_requests_together_answer_as_each_alone(audio_server):
    client = audio_server[0]
    first, second = encode_audio(clip(0.9, seed=8), "wav"), encode_audio(clip(1.9, seed=9), "flac")
    requests = [
        ((input_audio(first),), QUESTION),
        ((), "describe the image"),
        ((audio_url(second, "flac"),), "describe the image"),
        ((), QUESTION),
    ]
    alone = [answer_bytes(ask(client, *parts, text=text)) for parts, text in requests]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(
            pool.map(lambda request: answer_bytes(ask(client, *request[0], text=request[1])), requests)
        )
    assert together == alone


@pytest.mark.parametrize(
    "part, code",
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            "unsupported_media",
        ),
        (input_audio(encode_audio(clip(0.01, seed=0), "wav")), "invalid_media"),  # too short for one row
        (input_audio(b"RIFF\x00\x00\x00\x00WAVEnot really"), "invalid_media"),
        (audio_url(encode_audio(clip(0.5, seed=0), "wav"), "mp3"), "invalid_media"),  # a WAV called MP3
    ],
)
def test_bad_audio_parts_are_400s_naming_the_part(audio_server, part, code):
    client = audio_server[0]
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, part)
    body = error.value.body
    assert body["param"].startswith("messages[0].content[0]") and body["code"] == code
    assert body["type"] == "invalid_request_error" and body["message"]


def test_the_offline_llm_answers_audio_as_the_server_does(audio_server):
    # vLLM's two shapes: chat with an input_audio part, and a raw prompt with multi_modal_data's
    # (samples, rate) expanding the template's one-placeholder run.
    from serval import LLM, SamplingParams
    from serval.serving.errors import InvalidRequestError

    client, directory, _ = audio_server
    data = encode_audio(clip(1.3, seed=12), "wav")
    served = ask(client, input_audio(data))
    llm = LLM(model=directory, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    content = [input_audio(data), {"type": "text", "text": QUESTION}]
    chat = llm.chat([{"role": "user", "content": content}], params)[0]
    assert chat.outputs[0].text == served.choices[0].message.content
    assert (chat.usage.num_prompt_tokens, chat.usage.num_audio_tokens) == (
        served.usage.prompt_tokens, served.usage.prompt_tokens_details.audio_tokens,
    )  # fmt: skip
    samples = decode_audio(io.BytesIO(data), "wav", MediaConfig(), "p").samples
    prompt = (
        f"<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    raw = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": (samples, SAMPLE_RATE)}}, params)[0]
    assert (
        raw.prompt_token_ids == chat.prompt_token_ids
        and raw.outputs[0].token_ids == chat.outputs[0].token_ids
    )
    # The same clip at 8 kHz is resampled as an upload of it is.
    slow = (samples[::2].copy(), SAMPLE_RATE // 2)
    assert (
        llm.generate({"prompt": prompt, "multi_modal_data": {"audio": slow}}, params)[0].outputs[0].token_ids
    )
    with pytest.raises(InvalidRequestError, match="1 audio placeholders for 2"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"audio": [(samples, SAMPLE_RATE)] * 2}}, params)
    with pytest.raises(InvalidRequestError, match="does not accept image"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": object()}}, params)
    assert not llm.engine.has_unfinished_requests()
