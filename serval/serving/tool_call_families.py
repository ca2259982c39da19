"""The tool-call formats of DeepSeek-V3/R1, DeepSeek-V3.1, Kimi-K2, GLM-4.5/4.6 and MiniMax-M2: marker-token
calls, named as vLLM's `--tool-call-parser` names them (serving/tool_calls.py registers them first, so their
markers win over Hermes' `<tool_call>`, which GLM-4.5's template also contains).

Each entry is the text the model's chat template writes for a call (the grammar makes exactly that text) and
the markers its parser reads (serving/tool_call_markup.py; the parser is more lenient about whitespace). The
chat templates they were read from are in tests/fixtures/templates/ (README.md there says where each is from).
"""

from __future__ import annotations

import re
from types import MappingProxyType

from serval.serving.tool_call_format import ToolCallFormat
from serval.serving.tool_call_markup import CallMarkers

# DeepSeek's markers use fullwidth bars and U+2581 (the "▁" of sentencepiece), not ASCII.
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGUMENTS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"  # fmt: skip
MINIMAX_CALLS_BEGIN, MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"

# The fallback system prompt, for DeepSeek's templates: they render earlier calls but never `tools`.
_DEEPSEEK_V3_PROMPT = (
    "You can call the functions below. Each line is one function, in JSON:\n{tools}\n\nTo call functions, "
    f"write {DS_CALLS_BEGIN}, then for each call {DS_CALL_BEGIN}function{DS_SEP}" "NAME\n```json\n"
    "ARGUMENTS\n```" f"{DS_CALL_END} (ARGUMENTS: a JSON object valid against the function's parameters; a "
    f"newline between calls), then {DS_CALLS_END}."
)  # fmt: skip
_DEEPSEEK_V31_PROMPT = (
    "## Tools\nYou can call the functions below. Each line is one function, in JSON:\n{tools}\n\nTo call "
    f"functions, write {DS_CALLS_BEGIN}, then for each call {DS_CALL_BEGIN}NAME{DS_SEP}ARGUMENTS{DS_CALL_END} "
    "(NAME: one of the functions; ARGUMENTS: a JSON object valid against its parameters; calls follow each "
    f"other with nothing between them), then {DS_CALLS_END}."
)
_KIMI_PROMPT = (
    "You can call the functions below. Each line is one function, in JSON:\n{tools}\n\nTo call functions, "
    f"write {KIMI_CALLS_BEGIN}, then for each call {KIMI_CALL_BEGIN}functions.NAME:INDEX{KIMI_ARGUMENTS}"
    f"ARGUMENTS{KIMI_CALL_END} (INDEX counts the calls from 0), then {KIMI_CALLS_END}."
)
_GLM45_PROMPT = (
    "# Tools\n\nYou may call one or more functions. Each line is one function, in JSON:\n{tools}\n\nWrite "
    "each call as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call> "
    "(a string VALUE as it is, any other as JSON)."
)
_MINIMAX_PROMPT = (
    "# Tools\nYou may call one or more tools. Each line is one tool, in JSON:\n{tools}\n\nTo call tools, "
    f'write {MINIMAX_CALLS_BEGIN}, then for each call <invoke name="NAME"> with one <parameter name="KEY">'
    f"VALUE</parameter> per argument (a string VALUE as it is, any other as JSON) and </invoke>, then "
    f"{MINIMAX_CALLS_END}."
)

_DEEPSEEK_V3_MARKERS = CallMarkers(
    DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, ("```", DS_CALL_END), arguments_open="```json",
    header=re.compile(re.escape(DS_CALL_BEGIN) + r"\s*(?:\w+\s*)?" + re.escape(DS_SEP) + r"\s*(?P<name>[^\n]+?)\s*"),
)  # fmt: skip
_DEEPSEEK_V31_MARKERS = CallMarkers(
    DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, (DS_CALL_END,), arguments_open=DS_SEP,
    header=re.compile(re.escape(DS_CALL_BEGIN) + r"\s*(?P<name>[^\n]+?)\s*"),
)  # fmt: skip
_KIMI_MARKERS = CallMarkers(
    KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, (KIMI_CALL_END,), arguments_open=KIMI_ARGUMENTS,
    header=re.compile(
        re.escape(KIMI_CALL_BEGIN) + r"\s*(?:functions\.)?(?P<name>[^\s:]+?)(?::(?P<id_index>\d+))?\s*"
    ),
    call_id="functions.{name}:{index}",  # the id Kimi-K2's template writes back into the history
)  # fmt: skip
_GLM45_MARKERS = CallMarkers(
    "", "", "<tool_call>", ("</tool_call>",), name_ends=("\n", "<"), key_open="<arg_key>",
    key_close="</arg_key>", value_open="<arg_value>", value_close="</arg_value>",
)  # fmt: skip
_MINIMAX_MARKERS = CallMarkers(
    MINIMAX_CALLS_BEGIN, MINIMAX_CALLS_END, '<invoke name="', ("</invoke>",), name_ends=('">',),
    key_open='<parameter name="', key_close='">', value_close="</parameter>",
)  # fmt: skip

FAMILY_FORMATS: MappingProxyType[str, ToolCallFormat] = MappingProxyType({
    # DeepSeek-V3 and R1 (their templates write ```json blocks; V3.1's do not, so this one is tried first).
    "deepseek_v3": ToolCallFormat(
        "deepseek_v3", DS_CALLS_BEGIN, "\n", f"{DS_CALL_BEGIN}function{DS_SEP}" "{name}\n```json\n",
        f"\n```{DS_CALL_END}", _DEEPSEEK_V3_PROMPT, (DS_CALLS_BEGIN,), section_begin=DS_CALLS_BEGIN,
        section_end=DS_CALLS_END, call_markers=_DEEPSEEK_V3_MARKERS, requires=("```json",),
        markup=(DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
    ),
    "deepseek_v31": ToolCallFormat(
        "deepseek_v31", DS_CALLS_BEGIN, "", f"{DS_CALL_BEGIN}" "{name}" f"{DS_SEP}", DS_CALL_END,
        _DEEPSEEK_V31_PROMPT, (DS_CALLS_BEGIN,), section_begin=DS_CALLS_BEGIN, section_end=DS_CALLS_END,
        call_markers=_DEEPSEEK_V31_MARKERS, markup=(DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
    ),
    # Kimi-K2's first template declares tools (tool_declare) without writing calls; later ones write them.
    "kimi_k2": ToolCallFormat(
        "kimi_k2", KIMI_CALLS_BEGIN, "", f"{KIMI_CALL_BEGIN}functions." "{name}:{index}" f"{KIMI_ARGUMENTS}",
        KIMI_CALL_END, _KIMI_PROMPT, (KIMI_CALLS_BEGIN, "<|im_system|>tool_declare"),
        section_begin=KIMI_CALLS_BEGIN, section_end=KIMI_CALLS_END, call_markers=_KIMI_MARKERS,
        markup=(KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_ARGUMENTS, KIMI_CALL_END),
    ),
    # GLM-4.5 and GLM-4.6 (their templates write the same call text).
    "glm45": ToolCallFormat(
        "glm45", "<tool_call>", "\n", "<tool_call>{name}\n", "</tool_call>", _GLM45_PROMPT, ("<arg_key>",),
        arguments_style="glm_xml", call_markers=_GLM45_MARKERS,
        markup=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ),
    "minimax_m2": ToolCallFormat(
        "minimax_m2", MINIMAX_CALLS_BEGIN, "", '<invoke name="{name}">\n', "</invoke>\n", _MINIMAX_PROMPT,
        (MINIMAX_CALLS_BEGIN,), section_begin=f"{MINIMAX_CALLS_BEGIN}\n", section_end=MINIMAX_CALLS_END,
        arguments_style="minimax_xml", call_markers=_MINIMAX_MARKERS, markup=(MINIMAX_CALLS_BEGIN, MINIMAX_CALLS_END),
    ),
})  # fmt: skip
