"""Reasoning formats: which model family's reasoning markup an answer holds, chosen from the chat template or
named by `--reasoning-parser` (vLLM's names).

Owns the registry. Every family here writes its reasoning as `<think>...</think>` (serving/reasoning.py splits
it, and knows from the rendered prompt whether the answer starts inside the block), so what a format adds is
how it is recognised, the chat-template variable that switches thinking on and off, and where the reasoning
goes: `reasoning_content`, or (minimax_m2_append_think, as vLLM's) the content, in its `<think>` block.

The switch: a request says `enable_thinking` or `thinking` (api/requests.py passes both names to every
template); `template_kwargs` also sets the one this family's template reads, so the request's choice reaches
the template whichever name it used. Kimi-K2-Thinking's and MiniMax-M2's templates have no switch: they
always think.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from serval.serving.reasoning import THINK_END, THINK_START

THINKING_NAMES = ("enable_thinking", "thinking")  # what a request may call the switch


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    markers: tuple[str, ...] = ()  # texts a chat template holds when it is this family's (any of them)
    switch: str | None = None  # the template variable that turns thinking off; None: the template has none
    in_content: bool = False  # the reasoning stays in content, inside its <think> block

    def is_named_by(self, template_source: str) -> bool:
        return any(m in template_source for m in self.markers) and (
            THINK_START in template_source or THINK_END in template_source
        )

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """The request's template variables with its thinking choice under this template's own name."""
        if self.switch is None or not kwargs or self.switch in kwargs:
            return kwargs
        chosen = next((kwargs[n] for n in THINKING_NAMES if n in kwargs), None)
        return kwargs if chosen is None else {**kwargs, self.switch: chosen}


# NOTE: order matters: the first format whose markers the template holds is chosen, so a family's own
# markers come before the generic ChatML one (qwen3).
REASONING_FORMATS: MappingProxyType[str, ReasoningFormat] = MappingProxyType({
    # DeepSeek-R1: the generation prompt opens <think> (the model never writes the opening tag).
    "deepseek_r1": ReasoningFormat("deepseek_r1", ("<｜Assistant｜><think>",)),
    # DeepSeek-V3.1: `thinking` (default off) makes the prompt end in <think>, else in </think>.
    "deepseek_v3": ReasoningFormat("deepseek_v3", ("<｜Assistant｜>",), switch="thinking"),
    # GLM-4.5/4.6: `enable_thinking` false renders an empty <think></think> (and /nothink) into the prompt.
    "glm45": ReasoningFormat("glm45", ("[gMASK]<sop>",), switch="enable_thinking"),
    # MiniMax-M2: the generation prompt opens <think>; the model is meant to see its reasoning again.
    "minimax_m2": ReasoningFormat("minimax_m2", ("]~b]ai",)),
    "minimax_m2_append_think": ReasoningFormat("minimax_m2_append_think", in_content=True),
    # Kimi-K2-Thinking: the model writes <think>...</think> itself after <|im_assistant|>assistant<|im_middle|>.
    "kimi_k2": ReasoningFormat("kimi_k2", ("<|im_assistant|>",)),
    "qwen3": ReasoningFormat("qwen3", ("<|im_start|>",), switch="enable_thinking"),
})  # fmt: skip
# A thinking template of no family above: <think> split out, thinking switched by both names.
GENERIC = ReasoningFormat("think")


def reasoning_format_for_template(
    template_source: str | None, name: str | None = None
) -> ReasoningFormat | None:
    """The format named, else the family whose markers the chat template holds, else the generic one for a
    template that mentions <think>, else None (the answer is not split)."""
    if name is not None:
        if name not in REASONING_FORMATS:
            known = ", ".join(sorted(REASONING_FORMATS))
            raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
        return REASONING_FORMATS[name]
    if not template_source or (THINK_START not in template_source and THINK_END not in template_source):
        return None
    for candidate in REASONING_FORMATS.values():
        if candidate.markers and candidate.is_named_by(template_source):
            return candidate
    return GENERIC
