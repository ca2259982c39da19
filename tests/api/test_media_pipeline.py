"""Media through a real server on loopback (uvicorn, the real app, the real openai client), with a test-only
MediaProcessor standing in for the multimodal model the next task builds: every part is fetched (from a
loopback HTTP server, allowed by the test-only switch; a local directory; inline data), decoded and counted,
its placeholder run lands in the prompt where its message's content list puts it, usage reports tokens by modality, and every
broken or refused part is a 400 naming it. The scripted engine only echoes text: no encoder runs here."""

from __future__ import annotations

import base64
import math

import openai
import pytest

from serval.api.app import build_app
from serval.server_config import ServerConfig
from serval.serving.frontend import Frontend
from serval.serving.media.decode import DecodedAudio, DecodedImage, DecodedVideo
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaKind
from serval.serving.media.resize import ResizeBounds
from tests.fixtures.inprocess_server import serving
from tests.serving.fakes import ByteTokenizer, FakeEngine
from tests.serving.media.files import audio_bytes, image_bytes, png_bomb, video_bytes
from tests.serving.media.http_server import MediaServer

PLACEHOLDER_ID = 0  # a byte no test text holds


class ProbeProcessor:
    """A MediaProcessor for tests: Qwen2-VL's counting (one token per 28 x 28 pixels), 25 tokens a second of
    audio (Qwen2-Audio's rate), runs of one placeholder id."""

    accepts = frozenset(MediaKind)
    resize_bounds = ResizeBounds()

    def num_tokens(self, decoded) -> int:
        if isinstance(decoded, DecodedImage):
            return decoded.pixels.shape[0] * decoded.pixels.shape[1] // 784
        if isinstance(decoded, DecodedVideo):
            return decoded.frames.shape[0] * decoded.frames.shape[1] * decoded.frames.shape[2] // 784
        assert isinstance(decoded, DecodedAudio)
        return math.ceil(decoded.duration * 25)

    def placeholder_ids(self, item) -> list[int]:
        return [PLACEHOLDER_ID] * item.num_tokens

    def encoder_input(self, decoded, content_hash):
        return None  # no encoder behind the scripted engine


class RecordingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__(["ok"], max_model_len=8192)
        self.prompts: list[list[int]] = []

    def add_requests(self, requests, shared_queue=None):
        self.prompts.extend(list(r.prompt_token_ids) for r in requests)
        return super().add_requests(requests, shared_queue)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def media_server():
    files = {"/cat.png": image_bytes(300, 100), "/bomb.png": png_bomb(), "/clip.mp4": video_bytes(2.0)}
    with MediaServer(files) as server:
        yield server


@pytest.fixture(scope="module")
def served(tmp_path_factory, media_server):
    root = tmp_path_factory.mktemp("media-root")
    (root / "photo.jpg").write_bytes(image_bytes(56, 56, "JPEG"))
    (root / "broken.jpg").write_bytes(image_bytes(200, 200, "JPEG")[:300])
    (root.parent / "outside.png").write_bytes(image_bytes(56, 56))
    engine = RecordingEngine()
    media = MediaConfig(
        local_media_root=str(root), allowed_domains=("127.0.0.1",), allow_loopback_for_tests=True
    )
    frontend = Frontend(engine, ByteTokenizer(), media_config=media, media_processor=ProbeProcessor())
    app = build_app(ServerConfig(served_model_names=("probe",)), frontend)
    with serving(app) as port:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        yield client, engine, media_server


def ask(client, *parts, **extra):
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return client.chat.completions.create(
        model="probe", messages=[{"role": "user", "content": content}], max_tokens=4, extra_body=extra or None
    )


def test_every_source_is_fetched_decoded_and_placed(served):
    client, engine, media_server = served
    wav = base64.b64encode(audio_bytes(1.0, 16_000, "wav")).decode()
    response = ask(
        client,
        {"type": "image_url", "image_url": {"url": media_server.url("/cat.png")}},  # 300x100 -> 308x112: 44
        {"type": "image_url", "image_url": "file://photo.jpg"},  # 56x56: 4
        {"type": "video_url", "video_url": media_server.url("/clip.mp4"), "fps": 1},  # 2 frames of 56x56: 8
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},  # 1 s: 25
    )
    details = response.usage.prompt_tokens_details.model_dump()
    assert (details["image_tokens"], details["video_tokens"], details["audio_tokens"]) == (48, 8, 25)
    assert details["text_tokens"] == response.usage.prompt_tokens - 81
    prompt = engine.prompts[-1]
    assert len(prompt) == response.usage.prompt_tokens
    # The four runs sit together after the message's text, in the parts' order, as the content list has them.
    start = prompt.index(PLACEHOLDER_ID)
    assert prompt[start : start + 81] == [PLACEHOLDER_ID] * 81 and PLACEHOLDER_ID not in prompt[start + 81 :]
    assert bytes(prompt[start - 13 : start]) == b"What is this?"


def test_media_sit_between_the_texts_where_the_content_list_puts_them(served):
    client, engine, _ = served
    wav = base64.b64encode(audio_bytes(1.0, 16_000, "wav")).decode()
    audio = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}  # 25 tokens
    content = [audio, {"type": "text", "text": "one"}, {"type": "text", "text": "two"}, audio,
               {"type": "text", "text": "three"}, audio]  # fmt: skip
    client.chat.completions.create(
        model="probe", messages=[{"role": "user", "content": content}], max_tokens=4
    )
    prompt = engine.prompts[-1]
    start = prompt.index(PLACEHOLDER_ID)
    run = [PLACEHOLDER_ID] * 25
    # Adjacent text parts join with a newline; a media part adds nothing around its run.
    expected = [*run, *b"one\ntwo", *run, *b"three", *run]
    assert prompt[start : start + len(expected)] == expected


def test_pixel_controls_change_the_count(served):
    client, _, _ = served
    png = data_url("image/png", image_bytes(300, 100))
    small = ask(client, {"type": "image_url", "image_url": {"url": png}, "max_pixels": 3136})
    assert small.usage.prompt_tokens_details.model_dump()["image_tokens"] == 3  # 28 x 84
    large = ask(client, {"type": "image_url", "image_url": {"url": png}, "min_pixels": 200_704})
    assert large.usage.prompt_tokens_details.model_dump()["image_tokens"] == 280  # 280 x 784 pixels


@pytest.mark.parametrize(
    "part, param, words",
    [
        ({"type": "image_url", "image_url": "MEDIA/bomb.png"}, "messages[0].content[1]", "more than 67108864 pixels"),
        ({"type": "image_url", "image_url": "file://broken.jpg"}, "messages[0].content[1]", "truncated or corrupt"),
        ({"type": "image_url", "image_url": "../outside.png"}, "messages[0].content[1]", "outside the allowed"),
        ({"type": "image_url", "image_url": "MEDIA/clip.mp4"}, "messages[0].content[1]", "not image"),
        ({"type": "image_url", "image_url": "http://localhost/cat.png"}, "messages[0].content[1]", "allowlist"),
        ({"type": "image_url", "image_url": data_url("image/png", image_bytes(8, 8, "JPEG"))},
         "messages[0].content[1]", "declared as png but the content is jpeg"),
        ({"type": "video_url", "video_url": "MEDIA/clip.mp4", "fps": 20}, "messages[0].content[1].fps", "[0.1, 10.0]"),
    ],
)  # fmt: skip
def test_broken_and_refused_parts_are_400s(served, part, param, words):
    client, _, media_server = served
    payload = next(iter(v for k, v in part.items() if k.endswith("url")))
    if isinstance(payload, str) and payload.startswith("MEDIA"):
        part = {**part, part["type"]: media_server.url(payload[len("MEDIA") :])}
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, part)
    body = error.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == param and words in body["message"], body
