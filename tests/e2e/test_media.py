"""The real server with the default (text-only) model and the real openai client: every media kind is
refused by name with a 400 naming the part, after the part itself was checked, and nothing is fetched."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.serving.media.http_server import MediaServer

pytestmark = pytest.mark.slow

WAV = base64.b64encode(b"RIFF\0\0\0\0WAVEfmt ").decode()


@pytest.mark.parametrize(
    "part, kind",
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "image"),
        ({"type": "image_url", "image_url": "demo.png"}, "image"),
        ({"type": "video_url", "video_url": {"url": "file://clip.mp4"}, "fps": 2}, "video"),
        ({"type": "video", "video": ["a.jpg", "b.jpg"]}, "video"),
        ({"type": "audio_url", "audio_url": "https://example.com/a.mp3"}, "audio"),
        ({"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}, "audio"),
    ],
)
def test_a_text_only_model_refuses_media_by_name(openai_client, server, part, kind):
    content = [{"type": "text", "text": "What is this?"}, part]
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    body = error.value.body
    assert body["message"] == f"model {server.model!r} does not accept {kind} inputs"
    assert body["param"] == "messages[0].content[1]" and body["code"] == "unsupported_media"


def test_a_malformed_part_is_named_before_the_refusal(openai_client, server):
    bad = {"type": "video_url", "video_url": "clip.mp4", "fps": 50}
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": [bad]}], max_tokens=2
        )
    assert error.value.body["param"] == "messages[0].content[0].fps"


def test_nothing_is_fetched_for_a_text_only_model(openai_client, server):
    with MediaServer({"/cat.png": b"\x89PNG"}) as media:
        part = {"type": "image_url", "image_url": {"url": media.url("/cat.png")}}
        with pytest.raises(openai.BadRequestError):
            openai_client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": [part]}], max_tokens=2
            )
        assert media.num_requests == 0
    # And the server serves on.
    answer = openai_client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert answer.usage.prompt_tokens_details.model_dump()["text_tokens"] == answer.usage.prompt_tokens
