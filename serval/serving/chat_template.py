"""ChatTemplate: renders a model's own Jinja chat template into segments of template text and client text.

Owns two guarantees. The template runs in jinja2's ImmutableSandboxedEnvironment, so a template (or a value
passed through chat_template_kwargs) cannot reach Python internals or mutate its inputs. And text a client sent
never becomes control tokens: every message's text is replaced by a unique placeholder before rendering, the
rendered string is split at the placeholders, and the caller encodes template segments with special-token
parsing and client segments without it. Otherwise a user typing "<|im_end|>" could close their own turn.

A client text may also hold a cache marker (explicit prompt caching, placed by the frontend): the text is
split there into two client segments, the first flagged, so the caller knows where the pinned prefix ends.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names the renderer sets itself; chat_template_kwargs cannot replace them.
RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


@dataclass(frozen=True)
class Segment:
    text: str
    is_client_text: bool  # True: encode as plain text, never as special tokens
    ends_cache_prefix: bool = False  # the explicit-cache prefix (cache_control) ends with this segment


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Hugging Face templates expect tojson to keep non-ASCII text as is (jinja's default escapes it).
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        # trim_blocks/lstrip_blocks: the settings transformers renders templates with, so output matches.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        cache_marker: str | None = None,
    ) -> list[Segment]:
        """Render `messages` (dicts with a string "content") into segments.

        continue_final_message: the last message is an assistant turn to be continued, so the rendered text is
        cut right after its content (dropping the end-of-turn marks the template adds).
        cache_marker: a string inside one message's text where the explicit-cache prefix ends; removed.
        """
        nonce = secrets.token_hex(8)
        pattern = re.compile(f"SERVALTEXT{nonce}N(\\d+)E")
        texts: list[str] = []
        masked = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                # NOTE: placeholders are letters and digits only, so templates that strip or trim the content
                # keep them intact; a template that inspects the text itself (e.g. splits at "</think>") sees
                # the placeholder instead. That trade buys the guarantee above.
                message = {**message, "content": f"SERVALTEXT{nonce}N{len(texts)}E"}
                texts.append(content)
            masked.append(message)
        context = {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_NAMES}
        try:
            rendered = self.template.render(
                **context,
                messages=masked,
                tools=tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
        if continue_final_message:
            rendered = self._cut_after_final(rendered, pattern, len(texts) - 1, messages)
        return _split(rendered, pattern, texts, cache_marker)

    @staticmethod
    def _cut_after_final(rendered: str, pattern: re.Pattern, final_index: int, messages: list[dict]) -> str:
        if final_index < 0 or not isinstance(messages[-1].get("content"), str):
            raise ChatTemplateError("continuing the final message needs it to have text content")
        ends = [m.end() for m in pattern.finditer(rendered) if int(m.group(1)) == final_index]
        if not ends:
            raise ChatTemplateError("the chat template dropped the final message, so it cannot be continued")
        return rendered[: ends[-1]]


def _split(
    rendered: str, pattern: re.Pattern, texts: list[str], cache_marker: str | None = None
) -> list[Segment]:
    segments: list[Segment] = []
    position = 0
    for match in pattern.finditer(rendered):
        if match.start() > position:
            segments.append(Segment(rendered[position : match.start()], is_client_text=False))
        text = texts[int(match.group(1))]
        if cache_marker and cache_marker in text:
            # NOTE: the two halves are encoded apart, so the prefix's tokens do not depend on what follows
            # it: a later request with the same prefix and another continuation finds the same blocks.
            head, text = text.split(cache_marker, 1)
            segments.append(Segment(head, is_client_text=True, ends_cache_prefix=True))
        if text:
            segments.append(Segment(text, is_client_text=True))
        position = match.end()
    if position < len(rendered):
        segments.append(Segment(rendered[position:], is_client_text=False))
    return segments
