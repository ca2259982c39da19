"""Every spelling of a media part parses into the MediaPart it means; every malformed one is a 400 naming
the field (table-driven, no I/O)."""

from __future__ import annotations

import base64

import pytest

from serval.api.errors import APIError
from serval.api.media_parts import chat_media_parts, media_part
from serval.api.openai import ChatMessage
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaError, MediaKind, check_accepted

CONFIG = MediaConfig(max_image_bytes=64, max_input_audio_bytes=32)
W = "messages[0].content[1]"
PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 8).decode()


def parse(part: dict, high_resolution: bool = False):
    return media_part(part, W, CONFIG, high_resolution)


@pytest.mark.parametrize(
    "part, kind, scheme, location",
    [
        ({"type": "image_url", "image_url": "demo.png"}, MediaKind.IMAGE, "path", "demo.png"),
        ({"type": "image_url", "image_url": {"url": "demo.png"}}, MediaKind.IMAGE, "path", "demo.png"),
        ({"type": "image_url", "image_url": {"url": "file://demo.png"}}, MediaKind.IMAGE, "path", "demo.png"),
        ({"type": "image_url", "image_url": {"url": "file:///data/a.png"}}, MediaKind.IMAGE, "path", "/data/a.png"),
        ({"type": "image_url", "image_url": {"url": "HTTPS://x.org/a.png"}}, MediaKind.IMAGE, "http", "HTTPS://x.org/a.png"),
        ({"type": "image", "image": "http://x.org/a.png"}, MediaKind.IMAGE, "http", "http://x.org/a.png"),
        ({"type": "video_url", "video_url": "clip.mp4"}, MediaKind.VIDEO, "path", "clip.mp4"),
        ({"type": "video_url", "video_url": {"url": "https://x.org/v.mp4"}}, MediaKind.VIDEO, "http", "https://x.org/v.mp4"),
        ({"type": "audio_url", "audio_url": {"url": "file://a.wav"}}, MediaKind.AUDIO, "path", "a.wav"),
        ({"type": "audio", "audio": "a.flac"}, MediaKind.AUDIO, "path", "a.flac"),
        ({"type": "input_audio", "input_audio": {"data": "https://x.org/a.mp3", "format": "MP3"}}, MediaKind.AUDIO,
         "http", "https://x.org/a.mp3"),
    ],
)  # fmt: skip
def test_url_spellings(part, kind, scheme, location):
    parsed = parse(part)
    assert parsed.kind is kind and parsed.param == W and len(parsed.sources) == 1
    assert (parsed.sources[0].scheme, parsed.sources[0].location) == (scheme, location)


def test_inline_data():
    source = parse({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}}).sources[0]
    assert source.scheme == "data" and source.data.startswith(b"\x89PNG") and source.declared_format == "png"
    audio = parse(
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(b"ID3abc").decode(), "format": "wav"},
        }
    )
    assert audio.sources[0].data == b"ID3abc" and audio.sources[0].declared_format == "wav"
    assert audio.sources[0].max_bytes == 32  # input_audio's own cap
    url = parse(
        {"type": "input_audio", "input_audio": {"data": "data:audio/x-wav;base64,UklG", "format": "wav"}}
    )
    assert url.sources[0].data == b"RIF"


def test_video_as_a_list_of_images_and_the_options():
    part = parse({"type": "video", "video": ["a.jpg", {"url": "http://x.org/b.jpg"}], "fps": 1,
                  "min_pixels": 3136, "max_pixels": 50176, "total_pixels": 100352})  # fmt: skip
    assert part.kind is MediaKind.VIDEO and part.is_frame_list and len(part.sources) == 2
    assert (part.options.min_pixels, part.options.max_pixels, part.options.total_pixels) == (
        3136,
        50176,
        100352,
    )
    assert part.options.fps == 1.0
    inside = parse({"type": "video_url", "video_url": {"url": "v.mp4", "fps": 0.1}}, high_resolution=True)
    assert inside.options.fps == 0.1 and inside.options.high_resolution
    assert parse({"type": "video_url", "video_url": "v.mp4"}).options.fps == 2.0


@pytest.mark.parametrize(
    "part, param, words",
    [
        ({"type": "image_url"}, f"{W}.image_url", "required"),
        ({"type": "image_url", "image_url": {"url": ""}}, f"{W}.image_url.url", "non-empty string"),
        ({"type": "image_url", "image_url": 5}, f"{W}.image_url", "non-empty string"),
        ({"type": "image_url", "image_url": "ftp://x.org/a.png"}, f"{W}.image_url", "scheme 'ftp'"),
        ({"type": "image_url", "image_url": "https://u:p@x.org/a.png"}, f"{W}.image_url", "credentials"),
        ({"type": "image_url", "image_url": "http://x.org:99999/a.png"}, f"{W}.image_url", "not a valid URL"),
        ({"type": "image_url", "image_url": "file://"}, f"{W}.image_url", "names no file"),
        ({"type": "image_url", "image_url": "data:image/png,abc"}, f"{W}.image_url", "base64"),
        ({"type": "image_url", "image_url": "data:video/mp4;base64,AAAA"}, f"{W}.image_url", "not an accepted image type"),
        ({"type": "image_url", "image_url": "data:image/gif;base64,AAAA"}, f"{W}.image_url", "not an accepted image type"),
        ({"type": "image_url", "image_url": "data:image/png;base64,@@@@"}, f"{W}.image_url", "not valid base64"),
        ({"type": "image_url", "image_url": "data:image/png;base64," + "A" * 200}, f"{W}.image_url", "the limit"),
        ({"type": "audio_url", "audio_url": "data:image/png;base64,AAAA"}, f"{W}.audio_url", "not an accepted audio type"),
        ({"type": "input_audio", "input_audio": "abc"}, f"{W}.input_audio", '"data", "format"'),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}, f"{W}.input_audio.format", "mp3"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA"}}, f"{W}.input_audio.format", "mp3"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, f"{W}.input_audio.data", "base64"),
        ({"type": "input_audio", "input_audio": {"data": "A" * 100, "format": "wav"}}, f"{W}.input_audio.data",
         "limit"),
        ({"type": "input_audio", "input_audio": {"data": "data:audio/flac;base64,AAAA", "format": "wav"}},
         f"{W}.input_audio.format", "data URL says flac"),
        ({"type": "video", "video": []}, f"{W}.video", "non-empty list"),
        ({"type": "video", "video": ["a.jpg", 3]}, f"{W}.video[1]", "non-empty string"),
        ({"type": "video_url", "video_url": "v.mp4", "fps": 0.05}, f"{W}.fps", "[0.1, 10.0]"),
        ({"type": "video_url", "video_url": "v.mp4", "fps": 11}, f"{W}.fps", "[0.1, 10.0]"),
        ({"type": "video_url", "video_url": "v.mp4", "fps": "2"}, f"{W}.fps", "a number"),
        ({"type": "video_url", "video_url": {"url": "v.mp4", "fps": True}}, f"{W}.video_url.fps", "a number"),
        ({"type": "image_url", "image_url": "a.png", "min_pixels": 100}, f"{W}.min_pixels", "[784, "),
        ({"type": "image_url", "image_url": "a.png", "max_pixels": 10**9}, f"{W}.max_pixels", "12845056]"),
        ({"type": "image_url", "image_url": "a.png", "max_pixels": 1e6}, f"{W}.max_pixels", "an integer"),
        ({"type": "image_url", "image_url": "a.png", "min_pixels": 9000, "max_pixels": 5000}, f"{W}.min_pixels",
         "must not exceed"),
        ({"type": "video_url", "video_url": "v.mp4", "total_pixels": 0}, f"{W}.total_pixels", "[784, "),
    ],
)  # fmt: skip
def test_malformed_parts_are_400s_naming_the_field(part, param, words):
    with pytest.raises(APIError) as error:
        parse(part)
    assert error.value.status_code == 400 and error.value.param == param
    assert words in error.value.message


def test_media_only_in_user_messages_and_counted():
    part = {"type": "image_url", "image_url": "a.png"}
    messages = [ChatMessage(role="system", content=[part])]
    with pytest.raises(APIError) as error:
        chat_media_parts(messages, CONFIG)
    assert error.value.param == "messages[0].content[0]"
    many = [ChatMessage(role="user", content=[part] * 65)]
    with pytest.raises(APIError, match="more than 64 media files"):
        chat_media_parts(many, CONFIG)
    text = {"type": "text", "text": "hi"}
    parts = chat_media_parts([ChatMessage(role="user", content="hi"), ChatMessage(role="user", content=[text, part])],
                             CONFIG)  # fmt: skip
    assert [p.param for p in parts] == ["messages[1].content[1]"]


def test_a_text_only_model_refuses_each_kind_by_name():
    for part in ({"type": "image_url", "image_url": "a.png"}, {"type": "video", "video": ["a.png"]},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):  # fmt: skip
        parsed = parse(part)
        with pytest.raises(MediaError) as error:
            check_accepted([parsed], frozenset(), "smol")
        assert str(error.value) == f"model 'smol' does not accept {parsed.kind.value} inputs"
        assert error.value.param == W and error.value.code == "unsupported_media"
    check_accepted([parse({"type": "image_url", "image_url": "a.png"})], frozenset({MediaKind.IMAGE}), "vl")
