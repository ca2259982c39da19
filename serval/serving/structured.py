"""Structured output: JSON schemas and structural tags compiled into token grammars, and their matchers.

Owns the grammar backend. It is xgrammar: maintained (by the MLC team; vLLM, SGLang and TensorRT-LLM ship
it), it compiles JSON Schema, EBNF, regexes and "structural tags" (free text in which a trigger such as
`<tool_call>` opens a region checked against a schema) into a pushdown automaton whose per-token masks are
mostly precomputed, so the mask for one step costs microseconds on the CPU. Outlines (regex automata) cannot
mix free text with checked regions. llguidance can, and compiles 7-50x faster, but its masks cost 3-10x more
per step (bench/grammar_engines.py; docs/structured-output.md says why the step cost decides).

What must hold:
- Compiling happens here, before the request is submitted, in a worker thread with a time limit: a schema too
  large or too slow to compile is a 400, never a stalled engine. The cap on schema size bounds the work a
  compile that overran its limit keeps doing in its thread.
- A JSON Schema keyword that xgrammar would silently not enforce is a 400 naming the keyword, so "valid by
  construction" stays true; annotations (title, description, ...) and unknown keywords are ignored, as JSON
  Schema says.
- Special tokens (other than the end-of-generation ones, which end a complete grammar) are never allowed
  inside a grammar: the detokenizer would drop them and the text would no longer match.
- NOTE: tokens holding a C0 control character other than tab, newline and carriage return are left out of
  every grammar's vocabulary: xgrammar's length-bounded JSON strings (maxLength) admit raw control
  characters, which JSON forbids. A raw tab inside such a string is the one gap left (tabs are JSON
  whitespace and ordinary text, so they stay).
- Runs of JSON whitespace are capped (MAX_WHITESPACE): a small model can otherwise idle in whitespace until
  max_tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from serval.serving.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

MAX_SCHEMA_BYTES = 64 * 1024
MAX_WHITESPACE = 16
_CONTROL_BYTES = frozenset(range(32)) - {9, 10, 13}
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Validation keywords xgrammar does not enforce (or only for one case): refused by name.
UNENFORCEABLE_KEYWORDS = frozenset(
    {
        *("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies"),
        *("unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef"),
        *("minContains", "maxContains"),
    }
)
# Keys whose value is a schema, a list of schemas, or a map of name -> schema (where to walk next).
_SCHEMA_VALUED = frozenset({"items", "additionalProperties", "contains", "propertyNames", "additionalItems"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


class TokenVocabulary(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


def check_schema(schema: Any, param: str) -> None:
    """Raise InvalidRequestError for a schema xgrammar could not enforce (or that is too large)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("a JSON schema must be an object (or a boolean)", param)
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes", param)
    for path, node in _schema_nodes(schema, "#"):
        for keyword in [k for k in node if k in UNENFORCEABLE_KEYWORDS][
            :1
        ]:  # the first, in the schema's order
            raise InvalidRequestError(
                f"JSON schema keyword {keyword!r} at {path} cannot be enforced by the grammar engine", param
            )
        if node.get("uniqueItems") is True:
            raise InvalidRequestError(
                f"JSON schema keyword 'uniqueItems' at {path} cannot be enforced by the grammar engine", param
            )
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise InvalidRequestError(
                f"JSON schema keyword 'allOf' with more than one schema at {path} cannot be enforced by the "
                "grammar engine",
                param,
            )


def _schema_nodes(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for key, value in node.items():
        if key in _SCHEMA_VALUED:
            if isinstance(value, list):  # draft-4 tuple form of items
                for i, item in enumerate(value):
                    yield from _schema_nodes(item, f"{path}/{key}/{i}")
            else:
                yield from _schema_nodes(value, f"{path}/{key}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                yield from _schema_nodes(item, f"{path}/{key}/{i}")
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, item in value.items():
                yield from _schema_nodes(item, f"{path}/{key}/{name}")


class Grammar:
    """A compiled grammar; each engine request gets its own matcher from `new_constraint`."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size

    def new_constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled, self.vocab_size)


class GrammarConstraint:
    """The engine's TokenConstraint over one xgrammar matcher (see engine/constraint.py)."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # (1, ceil(vocab_size / 32)) int32
        self.is_rejected = False

    def allowed_token_bitmask(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0]

    def accept_token(self, token_id: int) -> None:
        # The mask makes a rejection impossible; should one happen anyway, end the request rather than let
        # the matcher and the text drift apart.
        if not self.matcher.accept_token(token_id):
            self.is_rejected = True

    @property
    def is_finished(self) -> bool:
        return self.is_rejected or self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles response formats and structural tags for one tokenizer, with a cache and a time limit."""

    def __init__(self, tokenizer: TokenVocabulary, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._compiler: Any = None  # built on first use: importing xgrammar and indexing the vocabulary
        # NOTE: two workers, so one compile that overran its limit (it cannot be stopped) does not hold up
        # every later request.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="serval-grammar")

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar

            tokenizer = self.tokenizer
            stop_ids = set(tokenizer.eos_token_ids)
            vocab = []
            for token_id in range(tokenizer.vocab_size):
                if token_id in tokenizer.special_token_ids or token_id in stop_ids:
                    vocab.append(b"")  # xgrammar's mark of a special token: never part of the text
                    continue
                try:
                    text = tokenizer.token_bytes(token_id)
                except ValueError:  # a hole in the vocabulary
                    text = b""
                vocab.append(b"" if _CONTROL_BYTES.intersection(text) else text)
            info = xgrammar.TokenizerInfo(
                vocab,
                xgrammar.VocabType.RAW,
                vocab_size=tokenizer.vocab_size,
                stop_token_ids=sorted(stop_ids),
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    async def compile(self, spec: dict[str, Any], param: str) -> Grammar:
        """spec: {"type": "json_object"}, {"type": "json_schema", "schema": ..., "strict": bool}, or
        {"type": "structural_tag", "format": ...} (xgrammar's structural tag format)."""
        future = self._pool.submit(self._compile, spec, param)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"the grammar did not compile within {self.timeout_s:g} s: simplify the schema", param
            ) from None

    def compile_now(self, spec: dict[str, Any], param: str = "response_format") -> Grammar:
        """The same, in the calling thread and without the time limit (offline use, tests)."""
        return self._compile(spec, param)

    def _compile(self, spec: dict[str, Any], param: str) -> Grammar:
        compiler = self._get_compiler()
        kind = spec["type"]
        try:
            if kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(
                    json.dumps(spec["schema"]),
                    any_whitespace=True,
                    strict_mode=bool(spec.get("strict")),
                    max_whitespace_cnt=MAX_WHITESPACE,
                )
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(
                    json.dumps({"type": "structural_tag", "format": spec["format"]})
                )
            else:
                raise ValueError(f"unknown grammar type {kind!r}")
        except (RuntimeError, ValueError) as e:
            # xgrammar's messages carry a C++ source location first; the last line is the reason.
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"the schema cannot be compiled into a grammar: {reason}", param) from e
        return Grammar(compiled, self.tokenizer.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
