"""The offline LLM's media: vLLM's two shapes turned into what the server's path makes of media.

Owns (1) `multi_modal_data` of a text prompt (`{"prompt": ..., "multi_modal_data": {"image": PIL image or a
list, "audio": (samples, sample_rate) or a list}}`): each item is written as a lossless file (PNG; float32
WAV) and decoded by the server's own decoders (so it is resized and resampled exactly as an upload of it
is), prepared by the model's MediaProcessor, and its run of placeholder ids replaces the i-th one-token
placeholder of its kind in the prompt (`<|vision_start|><|image_pad|><|vision_end|>`,
`<|audio_bos|><|AUDIO|><|audio_eos|>`: what the model's chat template writes), as vLLM expands them; and (2)
`chat` messages: parsed by the API's own rules (api/chat_messages.py, api/media_parts.py) and rendered, loaded and
placed by serving's Frontend (the LLM's own, over its engine), so a conversation gets the ids an HTTP chat
request of it gets.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from serval.serving.errors import InvalidRequestError
from serval.serving.generation import OutputPlan
from serval.serving.media.decode import decode_audio, decode_image
from serval.serving.media.limits import MediaConfig
from serval.serving.media.parts import MediaError, MediaKind, MediaOptions
from serval.serving.media.processor import MediaItem, MediaProcessor, MediaSpan, content_hash, place_media
from serval.serving.media.resize import resize_bounds

_KINDS = {"image": MediaKind.IMAGE, "audio": MediaKind.AUDIO}


def multi_modal_prompt(
    prompt_ids: list[int], data: dict[str, Any], processor: MediaProcessor | None, config: MediaConfig
) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """The prompt ids with each item's run in place of its placeholder, and the runs' spans. ValueError
    (InvalidRequestError) for data the model cannot read or a count of placeholders that differs."""
    items: dict[MediaKind, list[MediaItem]] = {}
    for key, value in data.items():
        if key not in _KINDS:
            raise InvalidRequestError(f"multi_modal_data key {key!r} is not one of image, audio", "prompt")
        kind = _KINDS[key]
        if processor is None or kind not in processor.accepts:
            raise InvalidRequestError(f"the model does not accept {kind.value} inputs", "prompt")
        values = value if isinstance(value, list) else [value]
        items[kind] = [
            _item(kind, v, processor, config, f"multi_modal_data.{key}[{i}]") for i, v in enumerate(values)
        ]
    if not items:
        return prompt_ids, ()
    patterns = {kind: processor.prompt_placeholder(kind) for kind in items}
    ids: list[int] = []
    slots: list[int] = []
    ordered: list[MediaItem] = []
    used = dict.fromkeys(items, 0)
    position = 0
    while position < len(prompt_ids):
        kind = next((k for k, p in patterns.items() if prompt_ids[position : position + len(p)] == p), None)
        if kind is None or used[kind] == len(items[kind]):
            ids.append(prompt_ids[position])
            position += 1
            continue
        slots.append(len(ids))
        ordered.append(items[kind][used[kind]])
        used[kind] += 1
        position += len(patterns[kind])
    for kind, num_used in used.items():
        if num_used != len(items[kind]):
            raise InvalidRequestError(
                f"the prompt holds {num_used} {kind.value} placeholders for {len(items[kind])} {kind.value} items",
                "prompt",
            )
    ids, _, spans = place_media(ids, slots, ordered, processor)
    return ids, spans


def _item(
    kind: MediaKind, value: Any, processor: MediaProcessor, config: MediaConfig, param: str
) -> MediaItem:
    if kind is MediaKind.IMAGE:
        if not hasattr(value, "save"):
            raise InvalidRequestError(f"{param} must be a PIL image", "prompt")
        file = io.BytesIO()
        value.save(file, "PNG")
        file.seek(0)
        bounds = resize_bounds(processor.resize_bounds, MediaOptions())
        decoded = decode_image(file, "png", bounds, config, param)
    else:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise InvalidRequestError(f"{param} must be a (samples, sample_rate) tuple", "prompt")
        decoded = decode_audio(_float_wav(*value), "wav", config, param)
    digest = content_hash(kind, decoded)
    try:
        num_tokens = processor.num_tokens(decoded)
    except ValueError as e:
        raise MediaError(f"{param}: {e}", "prompt") from None
    return MediaItem(kind, decoded, digest, num_tokens, param, processor.encoder_input(decoded, digest))


def _float_wav(samples: Sequence[float] | np.ndarray, sample_rate: int) -> io.BytesIO:
    """Mono samples as a float32 WAV file (exact: decode_audio reads them back unchanged at 16 kHz)."""
    import av

    array = np.asarray(samples, dtype=np.float32)
    if array.ndim != 1:
        array = array.mean(axis=0) if array.shape[0] < array.shape[-1] else array.mean(axis=1)
    file = io.BytesIO()
    with av.open(file, "w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=int(sample_rate), layout="mono")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(array[None]), format="flt", layout="mono")
        frame.sample_rate = int(sample_rate)
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    file.seek(0)
    return file


async def chat_prompt(
    frontend, model: str, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs
) -> tuple[list[int], OutputPlan, tuple[MediaSpan, ...]]:
    """One conversation's prompt ids, output plan and media spans, as the HTTP chat route makes them (on the
    event loop the frontend runs on)."""
    from serval.api import chat_messages
    from serval.api.media_parts import chat_media_parts
    from serval.api.openai import ChatMessage
    from serval.serving.chat import ChatOptions, ChatPrompt

    parsed = [ChatMessage.model_validate(message) for message in messages]
    template_messages, continue_final = chat_messages.template_messages(parsed, None)
    media = chat_media_parts(parsed, frontend.media.config)
    frontend.check_media(media, model)
    prompt = ChatPrompt(
        template_messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
        template_kwargs=template_kwargs, media=media,
    )  # fmt: skip
    items = await frontend.media.load(media, frontend.media_processor) if media else []
    token_ids, plan, _, spans = await frontend.prepare_chat(prompt, ChatOptions(), items)
    return token_ids, plan, spans
