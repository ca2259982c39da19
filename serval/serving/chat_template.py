"""ChatTemplate: renders a model's own Jinja chat template into segments of template text and client text.

Owns two guarantees. The template runs in jinja2's ImmutableSandboxedEnvironment, so a template (or a value
passed through chat_template_kwargs) cannot reach Python internals or mutate its inputs. And text a client sent
never becomes control tokens: the client's strings (message text, reasoning, names, tool calls, tools and
their schemas, chat_template_kwargs values) are replaced by unique placeholders before rendering, the rendered
string is split at the placeholders (serving/client_text.py), and the caller encodes template segments with
special-token parsing and client segments without it. Otherwise a user typing "<|im_end|>" could close their
own turn, or a tool description could open a system turn.

Explicit prompt caching: the caller passes cache spans (message index, character span) beside the messages;
the message text the last span ends in is split there into two client segments, the first flagged, so the
caller knows at which token the pinned prefix ends. No marker is ever put into the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serval.serving.client_text import CacheSpan, ClientTexts, Segment, SpecialTexts, escape_placeholders

# Names the renderer sets itself; chat_template_kwargs cannot replace them.
RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Hugging Face templates expect tojson to keep non-ASCII text as is (jinja's default escapes it).
    # NOTE: sort_keys orders masked keys by their placeholders, not by the client's text.
    text = json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    return escape_placeholders(text, ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Iterable[str] | None = None,
    ) -> None:
        """special_tokens: the vocabulary's special-token texts (Tokenizer.special_token_texts). With them only
        client strings that could take part in one are cut out of the template text; without them, all are
        but the plain-identifier names templates look up (serving/client_text.py)."""
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
        self.special = SpecialTexts(special_tokens) if special_tokens is not None else None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        cache_spans: tuple[CacheSpan, ...] = (),
    ) -> list[Segment]:
        """Render `messages` (dicts with a string "content") into segments; every client string in
        `messages`, `tools` and the values of `template_kwargs` comes back as client segments.

        continue_final_message: the last message is an assistant turn to be continued, so the rendered text is
        cut right after its content (dropping the end-of-turn marks the template adds).
        cache_spans: stretches of message text marked for the explicit cache; the prefix ends with the last.
        """
        # NOTE: a template that inspects a masked text itself (e.g. splits content at "</think>") sees the
        # placeholder instead. That trade buys the guarantee above.
        client = ClientTexts(self.special)
        # Earlier spans end inside the last one's prefix: the last alone says where the pinned prefix ends.
        cut = max(cache_spans, key=lambda span: (span.message_index, span.end), default=None)
        masked = [
            client.mask_message(message, cut.end if cut is not None and cut.message_index == i else None)
            for i, message in enumerate(messages)
        ]
        context = {k: client.value(v) for k, v in (template_kwargs or {}).items() if k not in RESERVED_NAMES}
        try:
            rendered = self.template.render(
                **context,
                messages=masked,
                tools=client.value(tools) if tools is not None else None,
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
            rendered = self._cut_after_final(rendered, client, masked[-1].get("content") if masked else None)
        try:
            return client.split(rendered)
        except ValueError as e:
            raise ChatTemplateError(str(e)) from e

    @staticmethod
    def _cut_after_final(rendered: str, client: ClientTexts, final_content: Any) -> str:
        if not client.is_placeholder(final_content):
            raise ChatTemplateError("continuing the final message needs it to have text content")
        end = client.end_of(rendered, final_content)
        if end is None:
            raise ChatTemplateError("the chat template dropped the final message, so it cannot be continued")
        return rendered[:end]
