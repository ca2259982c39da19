"""Structured output: JSON schemas and structural tags compiled into token grammars, and their matchers.

Owns the grammar backend. It is xgrammar: maintained (by the MLC team; vLLM, SGLang and TensorRT-LLM ship
it), it compiles JSON Schema, EBNF, regexes and "structural tags" (free text in which a trigger such as
`<tool_call>` opens a region checked against a schema) into a pushdown automaton whose per-token masks are
mostly precomputed, so the mask for one step costs microseconds on the CPU. Outlines (regex automata) cannot
mix free text with checked regions. llguidance can, and compiles 7-50x faster, but its masks cost 3-10x more
per step (bench/grammar_engines.py; docs/structured-output.md says why the step cost decides).

What must hold:
- Compiling happens here, before the request is submitted, and is bounded in time and memory: a spec not
  seen before is first compiled in a worker process (serving/grammar_pool.py) that is killed at the deadline
  and has its address space capped, so a schema too slow or too large to compile is a 400 naming the
  parameter, the server's memory does not grow, and later requests find a fresh worker. Only a spec that
  passed is compiled again here, in a thread, for the engine's matchers (GrammarCompiler says why twice).
  Cheap limits come first: the schema's size (MAX_SCHEMA_BYTES) and nesting (MAX_SCHEMA_DEPTH).
- A JSON Schema keyword that xgrammar would silently not enforce is a 400 naming the keyword, so "valid by
  construction" stays true; annotations (title, description, ...) and unknown keywords are ignored, as JSON
  Schema says.
- Special tokens (other than the end-of-generation ones, which end a complete grammar) are never allowed
  inside a grammar: the detokenizer would drop them and the text would no longer match. The exception is a
  format whose answer is decoded with its special tokens (harmony's `<|channel|>` ...: `text_tokens`).
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
import hashlib
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from serval.engine.constraint import MAX_ROLLBACK_TOKENS, check_rollback
from serval.serving.errors import InvalidRequestError, ServerBusyError
from serval.serving.grammar_pool import GrammarLimits, GrammarPool, GrammarRefused

if TYPE_CHECKING:
    import torch

MAX_SCHEMA_BYTES = 64 * 1024
# Schemas nested in schemas (properties, items, anyOf, ...). xgrammar's compile time grows faster than the
# depth (64 nested objects: 0.1 s on the default vocabulary; 400: 12 s), and real schemas stay far below.
MAX_SCHEMA_DEPTH = 64
MAX_WHITESPACE = 16
_CONTROL_BYTES = frozenset(range(32)) - {9, 10, 13}
# Compiled grammars xgrammar keeps for reuse (it evicts the least recently used past this; a grammar a request
# still holds stays alive). Unbounded, a client sending a new schema per request would grow the server.
GRAMMAR_CACHE_BYTES = 256 << 20
# Specs whose verdict (passed, or the refusal's message) is remembered: 32-byte digests, so a few KB.
MAX_REMEMBERED_SPECS = 1024
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
    """Raise InvalidRequestError for a schema xgrammar could not enforce (or that is too large or deep)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError("a JSON schema must be an object (or a boolean)", param)
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes", param)
    for path, node, depth in _schema_nodes(schema, "#", 0):
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(
                f"the JSON schema nests schemas deeper than {MAX_SCHEMA_DEPTH} levels (at {path[:200]})",
                param,
            )
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


def _schema_nodes(node: Any, path: str, depth: int) -> Iterator[tuple[str, dict, int]]:
    # Depth first, so a caller that stops at the first node too deep never walks further down.
    if not isinstance(node, dict):
        return
    yield path, node, depth
    for key, value in node.items():
        if key in _SCHEMA_VALUED:
            if isinstance(value, list):  # draft-4 tuple form of items
                for i, item in enumerate(value):
                    yield from _schema_nodes(item, f"{path}/{key}/{i}", depth + 1)
            else:
                yield from _schema_nodes(value, f"{path}/{key}", depth + 1)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                yield from _schema_nodes(item, f"{path}/{key}/{i}", depth + 1)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, item in value.items():
                yield from _schema_nodes(item, f"{path}/{key}/{name}", depth + 1)


class Grammar:
    """A compiled grammar; each engine request gets its own matcher from `new_constraint`."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size

    def new_constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled, self.vocab_size)


class GrammarConstraint:
    """The engine's TokenConstraint over one xgrammar matcher (see engine/constraint.py)."""

    def __init__(
        self, compiled: Any, vocab_size: int, max_rollback_tokens: int = MAX_ROLLBACK_TOKENS
    ) -> None:
        import xgrammar

        self.compiled = compiled
        self.vocab_size = vocab_size
        # NOTE: no max_rollback_tokens for xgrammar: the pinned version deprecates it and keeps its whole
        # history. The window is enforced here instead, so every constraint keeps the one contract.
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # (1, ceil(vocab_size / 32)) int32
        self.max_rollback_tokens = max_rollback_tokens
        # Whether the matcher took each of the last accepted tokens (a rejected one left it where it was):
        # rollback takes back from the matcher only those it took.
        self.recent_advances: deque[bool] = deque(maxlen=max_rollback_tokens)
        self.num_rejected = 0

    def allowed_token_bitmask(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        return self.bitmask[0]

    def accept_token(self, token_id: int) -> None:
        # The mask makes a rejection impossible; should one happen anyway, end the request rather than let
        # the matcher and the text drift apart.
        advanced = self.matcher.accept_token(token_id)
        self.num_rejected += not advanced
        self.recent_advances.append(advanced)

    def rollback(self, num_tokens: int) -> None:
        check_rollback(num_tokens, len(self.recent_advances), self.max_rollback_tokens)
        taken_back = [self.recent_advances.pop() for _ in range(num_tokens)]
        self.num_rejected -= taken_back.count(False)
        if any(taken_back):
            self.matcher.rollback(sum(taken_back))

    @property
    def is_rejected(self) -> bool:
        return self.num_rejected > 0

    @property
    def is_finished(self) -> bool:
        return self.is_rejected or self.matcher.is_terminated()

    def __reduce__(self):
        # Sent to an engine replica in another process (serval/cluster/) before it ever samples: xgrammar's
        # objects don't pickle, so the compiled grammar and its tokenizer table travel as JSON and the matcher
        # starts afresh. NOTE: the table is ~1.6 MB for a 49k vocabulary, ~50 ms to read back, per request.
        compiled = self.compiled
        tokenizer_json = compiled.tokenizer_info.serialize_json()
        return (
            _constraint_from_json,
            (compiled.serialize_json(), tokenizer_json, self.vocab_size, self.max_rollback_tokens),
        )


def _constraint_from_json(
    compiled_json: str, tokenizer_json: str, vocab_size: int, max_rollback_tokens: int = MAX_ROLLBACK_TOKENS
) -> GrammarConstraint:
    import xgrammar

    tokenizer_info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_json)
    compiled = xgrammar.CompiledGrammar.deserialize_json(compiled_json, tokenizer_info)
    return GrammarConstraint(compiled, vocab_size, max_rollback_tokens)


class GrammarCompiler:
    """Compiles response formats and structural tags for one tokenizer: a spec not seen before is tried first
    in a GrammarPool worker (deadline, memory cap), then compiled here; xgrammar's cache keeps the results."""

    def __init__(
        self,
        tokenizer: TokenVocabulary,
        limits: GrammarLimits | None = None,
        text_tokens: frozenset[str] = frozenset(),
    ) -> None:
        """text_tokens: special tokens that grammars may write as text (the answer keeps them: harmony's)."""
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self.text_tokens = text_tokens
        self._compiler: Any = None  # built on first use: importing xgrammar and indexing the vocabulary
        self._gate: GrammarPool | None = None  # built with the compiler: its workers need the vocabulary
        self._build_lock = threading.Lock()
        # One thread per worker process, each waiting on its worker; and the threads that compile here, apart,
        # so that a spec seen before (mostly a hit in xgrammar's cache) never queues behind a slow new one.
        self._gate_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.limits.num_workers, thread_name_prefix="serval-grammar-gate"
        )
        self._compile_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.limits.num_workers, thread_name_prefix="serval-grammar"
        )
        # Digests of specs the gate has ruled on, so that no spec is tried in a worker twice: those that
        # passed compile here directly, those refused are refused at once with the same message.
        self._passed = _Digests(MAX_REMEMBERED_SPECS)
        self._refused = _Digests(MAX_REMEMBERED_SPECS)
        # Specs in a worker now, by digest: requests for the same new spec (a burst of one tool set) wait for
        # that one check instead of each taking a worker.
        self._checking: dict[bytes, concurrent.futures.Future] = {}
        self._checking_lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._build_lock:
            if self._compiler is None:
                import xgrammar

                from serval.serving.grammar_worker import GrammarVocabulary

                vocabulary = GrammarVocabulary(
                    _grammar_token_bytes(self.tokenizer, self.text_tokens),
                    self.tokenizer.vocab_size,
                    sorted(set(self.tokenizer.eos_token_ids)),
                )
                self._gate = GrammarPool(vocabulary, self.limits, MAX_WHITESPACE)
                self._compiler = xgrammar.GrammarCompiler(
                    vocabulary.tokenizer_info(), max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
            return self._compiler

    @property
    def num_live_workers(self) -> int:
        return 0 if self._gate is None else self._gate.num_live_workers

    @property
    def num_busy_workers(self) -> int:
        return 0 if self._gate is None else self._gate.num_busy_workers

    async def compile(self, spec: dict[str, Any], param: str) -> Grammar:
        """spec: {"type": "json_object"}, {"type": "json_schema", "schema": ..., "strict": bool}, or
        {"type": "structural_tag", "format": ...} (xgrammar's structural tag format). InvalidRequestError
        (naming `param`) if it does not compile within the limits; ServerBusyError if every worker was busy
        with other new grammars for a whole timeout."""
        digest = hashlib.sha256(json.dumps(spec).encode()).digest()
        try:
            refusal = self._refused.get(digest)
            if refusal is not None:
                raise GrammarRefused(refusal)
            if self._passed.get(digest) is None:
                # Shielded: a client that goes away must not cancel a check other requests wait for.
                await asyncio.shield(asyncio.wrap_future(self._check_once(digest, spec)))
                self._passed.put(digest, "")
            # NOTE: a spec that passed is compiled a second time, here. xgrammar's compiled grammar crosses a
            # process boundary only as JSON, which costs more than the compile (60 pattern properties: 0.2 s
            # to compile, 2.5 s to serialize, 1.3 s to read back, 64 MB of text). The worker has just shown
            # that this compile ends within the deadline and the memory cap; xgrammar releases the GIL.
            return await asyncio.wrap_future(self._compile_threads.submit(self._compile, spec))
        except GrammarRefused as e:
            self._refused.put(digest, str(e))
            raise InvalidRequestError(str(e), param) from None

    def compile_now(self, spec: dict[str, Any], param: str = "response_format") -> Grammar:
        """The same, in the calling thread and without the gate or its limits (offline use, tests)."""
        try:
            return self._compile(spec)
        except GrammarRefused as e:
            raise InvalidRequestError(str(e), param) from None

    def _check_once(self, digest: bytes, spec: dict[str, Any]) -> concurrent.futures.Future:
        with self._checking_lock:
            future = self._checking.get(digest)
            if future is None:
                future = self._gate_threads.submit(self._check, spec, time.monotonic())
                self._checking[digest] = future
                future.add_done_callback(lambda _: self._forget_check(digest))
            return future

    def _forget_check(self, digest: bytes) -> None:
        with self._checking_lock:
            self._checking.pop(digest, None)

    def _check(self, spec: dict[str, Any], submitted_at: float) -> None:
        # In a gate thread: GrammarRefused unless the spec compiled in a worker within the limits.
        self._get_compiler()
        assert self._gate is not None
        # NOTE: the wait for a free worker is bounded from when the workers were first ready: the first
        # structured requests wait for them to start (seconds, more on a busy machine), which is not a sign of
        # workers held by slow schemas.
        ready_at = self._gate.ready_at
        if ready_at is not None and time.monotonic() - max(submitted_at, ready_at) > self.limits.timeout_s:
            raise ServerBusyError(
                f"every grammar compile worker was busy for {self.limits.timeout_s:g} s: retry later"
            )
        self._gate.check(spec)

    def _compile(self, spec: dict[str, Any]) -> Grammar:
        from serval.serving.grammar_worker import CompileError, compile_spec

        try:
            compiled = compile_spec(self._get_compiler(), spec, MAX_WHITESPACE)
        except CompileError as e:
            raise GrammarRefused(f"the schema cannot be compiled into a grammar: {e}") from e
        return Grammar(compiled, self.tokenizer.vocab_size)

    def shutdown(self) -> None:
        self._gate_threads.shutdown(wait=False, cancel_futures=True)
        self._compile_threads.shutdown(wait=False, cancel_futures=True)
        if self._gate is not None:
            self._gate.close()


def _grammar_token_bytes(
    tokenizer: TokenVocabulary, text_tokens: frozenset[str] = frozenset()
) -> list[bytes]:
    """Each token's bytes as xgrammar sees them: b"" (never part of a grammar's text) for special and
    end-of-generation tokens (but those named in text_tokens), holes in the vocabulary and tokens holding a
    C0 control character."""
    stop_ids = set(tokenizer.eos_token_ids)
    kept = {text.encode() for text in text_tokens}
    vocab = []
    for token_id in range(tokenizer.vocab_size):
        try:
            text = tokenizer.token_bytes(token_id)
        except ValueError:  # a hole in the vocabulary
            text = b""
        is_special = token_id in tokenizer.special_token_ids and text not in kept
        if is_special or token_id in stop_ids:
            vocab.append(b"")  # xgrammar's mark of a special token
            continue
        vocab.append(b"" if _CONTROL_BYTES.intersection(text) else text)
    return vocab


class _Digests:
    """A bounded map of spec digests to a note, oldest forgotten first; safe across threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._notes: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> str | None:
        with self._lock:
            note = self._notes.get(digest)
            if note is not None:
                self._notes.move_to_end(digest)
            return note

    def put(self, digest: bytes, note: str) -> None:
        with self._lock:
            self._notes[digest] = note
            self._notes.move_to_end(digest)
            while len(self._notes) > self.capacity:
                self._notes.popitem(last=False)
