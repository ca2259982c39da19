"""The spec's rules for beam search requests, and what a valid one asks of the engine.

MindIE: `use_beam_search` can't be combined with `stop` / `stop_token_ids` or function calls, returns n
sequences (one when n is omitted), and leaves best_of unchecked. ModelArts: n must be above 1 when given,
with top_p 1.0, top_k -1 and temperature 0.0; `length_penalty` only with beam search and best_of > 1.
Where they differ both are accepted: an omitted n is MindIE's single answer, an explicit n = 1 is refused as
ModelArts refuses it. Every refusal is a 400 that names the rule and the parameter.
"""

from __future__ import annotations

from typing import Any

from serval.api.errors import invalid
from serval.api.openai import SamplingFields

# The beam width when neither n nor best_of asks for more than one sequence (MindIE's single answer).
DEFAULT_BEAM_WIDTH = 4


def check_not_beam_only(request: SamplingFields) -> None:
    """length_penalty and early_stopping only mean something to a beam search."""
    if request.length_penalty is not None and request.length_penalty != 1.0:
        raise invalid("length_penalty applies only to beam search: set use_beam_search", "length_penalty")
    if request.early_stopping is not None:
        raise invalid("early_stopping applies only to beam search: set use_beam_search", "early_stopping")


def beam_search_fields(request: SamplingFields, constrained_by: str | None = None) -> dict[str, Any]:
    """SamplingParams fields of a valid beam search request; raises the APIError of the first broken rule.
    constrained_by: the chat parameter that would put a grammar on the output (tools, response_format)."""
    if request.stop:
        raise invalid(
            "use_beam_search can't be combined with stop (beam search ends on EOS or length)", "stop"
        )
    if request.stop_token_ids:
        raise invalid("use_beam_search can't be combined with stop_token_ids", "stop_token_ids")
    if constrained_by == "tools":
        raise invalid("use_beam_search can't be combined with function calls (tools)", "tools")
    if constrained_by is not None:
        raise invalid(
            f"use_beam_search can't be combined with a constrained output ({constrained_by})", constrained_by
        )
    if request.n == 1:
        raise invalid("beam search needs n > 1 (omit n for a single answer)", "n")
    if request.temperature is not None and request.temperature != 0.0:
        raise invalid("beam search is deterministic: temperature must be 0 (or omitted)", "temperature")
    if request.top_p is not None and request.top_p != 1.0:
        raise invalid("beam search needs top_p 1.0 (or omitted)", "top_p")
    if request.top_k not in (None, -1, 0):
        raise invalid("beam search needs top_k -1 (or omitted)", "top_k")
    if request.min_p:
        raise invalid("beam search ranks beams by log-probability: min_p does not apply", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise invalid(f"beam search ranks beams by log-probability: {name} does not apply", name)
    if request.repetition_penalty not in (None, 1.0):
        raise invalid(
            "beam search ranks beams by log-probability: repetition_penalty does not apply",
            "repetition_penalty",
        )
    if request.logit_bias:
        raise invalid("beam search ranks beams by log-probability: logit_bias does not apply", "logit_bias")
    stopping = request.early_stopping
    if not (stopping is None or isinstance(stopping, bool) or stopping == "never"):
        raise invalid('early_stopping must be true, false or "never"', "early_stopping")
    n = request.n or 1
    width = max(n, request.best_of or 1)
    if width == 1:
        width = DEFAULT_BEAM_WIDTH
    if request.length_penalty not in (None, 1.0) and request.best_of == 1:
        raise invalid("length_penalty needs best_of > 1 (the beam width)", "best_of")
    return {
        "n": n,
        "best_of": width,
        "temperature": 0.0,
        "use_beam_search": True,
        "length_penalty": 1.0 if request.length_penalty is None else request.length_penalty,
        "early_stopping": False if request.early_stopping is None else request.early_stopping,
    }
