"""Grammar engines side by side: xgrammar (what serval ships) and llguidance, on the default model's vocabulary.

For each engine that imports in the running interpreter, prints one JSON line per measurement:
- the import, and the vocabulary setup (xgrammar TokenizerInfo + GrammarCompiler; llguidance LLTokenizer);
- the compile time of (a) json_object, (b) a 3-property strict schema, (c) a ~40 KB schema of nested
  objects, arrays and enums, (d) Hermes tool calls for two tools with tool_choice "auto" (free text until
  `<tool_call>`, then a schema-checked call: xgrammar's structural tag, llguidance's StructTag grammar);
- the per-step mask time over a walk of up to 200 tokens through a valid document (each step: fill the
  bitmask, check the document's token is allowed, accept it).

Both engines see the same vocabulary: serval's token bytes, with special, end-of-generation and
control-character tokens left out, exactly as `serving/structured.py` builds it. serval's tokenizer needs
torch (the GGUF reader), so the first run, in the project's venv, writes the vocabulary to a cache file that
a run in another venv (one with llguidance and no torch) reads:

    taskset -c 1 .venv/bin/python bench/grammar_engines.py                       # xgrammar, writes the cache
    taskset -c 1 /tmp/llg/bin/python bench/grammar_engines.py                    # llguidance, reads it

Compile times are the median of --repeats runs with caching off (xgrammar `cache_enabled=False`; llguidance
builds a new matcher each time). llguidance builds its lexer lazily, so part of its compile work moves into
the first masks: `first_mask_us` is reported on its own for that reason.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_CONTROL_BYTES = frozenset(range(32)) - {9, 10, 13}  # as serving/structured.py
MAX_WHITESPACE = 16
DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), "serval-grammar-bench-vocab.json")  # ~3 MB, not kept


# ---- the vocabulary


def export_vocab(path: str) -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from serval.model_source import resolve_model
    from serval.serving.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(resolve_model(None))
    tokens = []
    for token_id in range(tokenizer.vocab_size):
        try:
            tokens.append(tokenizer.token_bytes(token_id).hex())
        except ValueError:
            tokens.append("")
    vocab = {
        "vocab_size": tokenizer.vocab_size,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "special_token_ids": sorted(tokenizer.special_token_ids),
        "tokens": tokens,
        "tokenizer_json": tokenizer._backend.to_str(),
    }
    with open(path, "w") as f:
        json.dump(vocab, f)
    return vocab


def load_vocab(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return export_vocab(path)


def grammar_tokens(vocab: dict[str, Any]) -> list[bytes]:
    """The token bytes a grammar may use; b"" marks a token no grammar ever allows."""
    excluded = set(vocab["special_token_ids"]) | set(vocab["eos_token_ids"])
    out = []
    for token_id, hex_bytes in enumerate(vocab["tokens"]):
        text = bytes.fromhex(hex_bytes)
        out.append(b"" if token_id in excluded or _CONTROL_BYTES.intersection(text) else text)
    return out


# ---- the grammars and a valid document for each


def strict_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
        },
        "required": ["color", "count", "name"],
        "additionalProperties": False,
    }


def large_schema() -> dict[str, Any]:
    """~40 KB: 30 section objects, each of 12 properties mixing strings, enums, bounded integers, arrays of
    objects and a nested object."""

    def section(i: int) -> dict[str, Any]:
        props: dict[str, Any] = {}
        for j in range(4):
            props[f"label_{i}_{j}"] = {"type": "string", "maxLength": 32}
            props[f"kind_{i}_{j}"] = {"enum": [f"k{i}_{j}_{v}" for v in range(6)]}
        props[f"size_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        props[f"tags_{i}"] = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 4}
        props[f"items_{i}"] = {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "note": {"type": "string"}},
                "required": ["id", "note"],
                "additionalProperties": False,
            },
        }
        props[f"meta_{i}"] = {
            "type": "object",
            "properties": {"flag": {"type": "boolean"}, "ratio": {"type": "number"}},
            "required": ["flag", "ratio"],
            "additionalProperties": False,
        }
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    sections = {f"section_{i}": section(i) for i in range(30)}
    return {
        "type": "object",
        "properties": sections,
        "required": list(sections),
        "additionalProperties": False,
    }


def instance_of(schema: dict[str, Any]) -> Any:
    """A valid value of the schemas above (first enum value, the minimum, a short string, one item)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {name: instance_of(sub) for name, sub in schema.get("properties", {}).items()}
    if kind == "array":
        return [instance_of(schema["items"])]
    if kind == "integer":
        return schema.get("minimum", 0) + 1
    if kind == "number":
        return 0.5
    if kind == "boolean":
        return True
    return "some text"


TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]
TOOL_DOCUMENT = (
    "Let me look that up for you before answering the question about the weather.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)


def cases() -> list[tuple[str, str, dict[str, Any], str]]:
    """(name, kind, spec, a valid document)."""
    json_doc = {"store": {"name": "Corner shop", "open": True, "items": [
        {"id": i, "title": f"item number {i}", "price": i * 1.25, "tags": ["a", "b"]} for i in range(12)]}}  # fmt: skip
    strict_document = {"color": "green", "count": 3, "name": "a small green apple from the market"}
    large = large_schema()
    return [
        ("json_object", "json_object", {}, json.dumps(json_doc)),
        ("strict_3_properties", "json_schema", strict_schema(), json.dumps(strict_document)),
        ("large_40kb", "json_schema", large, json.dumps(instance_of(large))),
        ("tool_call_auto", "tools", {}, TOOL_DOCUMENT),
    ]


# ---- the engines


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], vocab: dict[str, Any]) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = vocab["vocab_size"]
        info = xgrammar.TokenizerInfo(
            tokens, xgrammar.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=vocab["eos_token_ids"]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: dict[str, Any]) -> Any:
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            return self.compiler.compile_json_schema(
                json.dumps(spec), any_whitespace=True, strict_mode=True, max_whitespace_cnt=MAX_WHITESPACE
            )
        tags = [
            {
                "type": "tag",
                "begin": f'<tool_call>\n{{"name": "{t["name"]}", "arguments": ',
                "content": {"type": "json_schema", "json_schema": t["parameters"], "max_whitespace_cnt": 16},
                "end": "}\n</tool_call>",
            }
            for t in TOOLS
        ]
        fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "stop_after_first": False}
        return self.compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))

    def matcher(self, compiled: Any) -> tuple[Any, Any]:
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token_id: int) -> bool:
        return matcher.accept_token(token_id)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokens: list[bytes], vocab: dict[str, Any]) -> None:
        import llguidance
        import llguidance.numpy

        self.llg = llguidance
        self.llg_numpy = llguidance.numpy
        self.vocab_size = vocab["vocab_size"]
        eos = vocab["eos_token_ids"]
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(vocab["tokenizer_json"])
        excluded = set(vocab["special_token_ids"]) | set(eos)
        # llguidance's convention for a token that is never text: its name behind a 0xFF byte.
        llg_tokens = [t if t else b"\xff<|hole_%d|>" % i for i, t in enumerate(tokens)]

        class _Wrapped:
            eos_token_id = eos[0]
            bos_token_id = None
            special_token_ids = sorted(excluded)

            def __init__(self) -> None:
                self.tokens = llg_tokens

            def __call__(self, text: bytes) -> list[int]:
                return backend.encode(text.decode("utf-8", "replace"), add_special_tokens=False).ids

        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Wrapped()), n_vocab=self.vocab_size, eos_token=eos
        )

    def compile(self, kind: str, spec: dict[str, Any]) -> Any:
        llg = self.llg
        # Whitespace as xgrammar is configured: any JSON whitespace, at most 16 in a run.
        options = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}
        if kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        elif kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(spec, defaults=options)
        else:
            tags = [
                llg.StructTag(
                    trigger="<tool_call>",
                    begin=f'<tool_call>\n{{"name": "{t["name"]}", "arguments": ',
                    grammar=t["parameters"],
                    end="}\n</tool_call>",
                )
                for t in TOOLS
            ]
            grammar = llg.StructTag.to_grammar(tags, assume_special=False)
        matcher = llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar, matcher

    def matcher(self, compiled: Any) -> tuple[Any, Any]:
        _, matcher = compiled  # the compile already built it (it is the compile)
        return matcher, self.llg_numpy.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        self.llg_numpy.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher: Any, token_id: int) -> bool:
        return matcher.consume_token(token_id)


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def _allowed(bitmask: Any, token_id: int) -> bool:
    return bool((int(bitmask[0][token_id // 32]) >> (token_id % 32)) & 1)


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def run_engine(name: str, vocab: dict[str, Any], tokens: list[bytes], args: argparse.Namespace) -> None:
    started = time.perf_counter()
    try:
        __import__(name)
    except ImportError:
        print(f"# {name} is not importable here: skipped", file=sys.stderr)
        return
    import_s = time.perf_counter() - started
    version = importlib.metadata.version(name)
    started = time.perf_counter()
    engine = ENGINES[name](tokens, vocab)
    setup_s = time.perf_counter() - started
    report(engine=name, version=version, measure="setup", import_s=round(import_s, 3),
           vocab_setup_s=round(setup_s, 3), vocab_size=vocab["vocab_size"])  # fmt: skip
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(vocab["tokenizer_json"])
    for case, kind, spec, document in cases():
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            compiled = engine.compile(kind, spec)
            times.append(time.perf_counter() - started)
        token_ids = backend.encode(document, add_special_tokens=False).ids[: args.steps]
        matcher, bitmask = engine.matcher(compiled)
        step_us = []
        for token_id in token_ids:
            started = time.perf_counter()
            engine.fill(matcher, bitmask)
            step_us.append((time.perf_counter() - started) * 1e6)
            if not _allowed(bitmask, token_id) or not engine.accept(matcher, token_id):
                raise RuntimeError(f"{name}/{case}: the document's token {token_id} was refused")
        ordered = sorted(step_us)
        report(
            engine=name, measure=case, schema_bytes=len(json.dumps(spec)),
            compile_ms=round(statistics.median(times) * 1e3, 2),
            first_compile_ms=round(times[0] * 1e3, 2), num_steps=len(step_us),
            first_mask_us=round(step_us[0], 1), mask_mean_us=round(statistics.fmean(step_us), 1),
            mask_p50_us=round(ordered[len(ordered) // 2], 1),
            mask_p99_us=round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1),
            mask_max_us=round(ordered[-1], 1),
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-cache", default=DEFAULT_CACHE, help="where the vocabulary is cached")
    parser.add_argument("--engines", default="xgrammar,llguidance")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    vocab = load_vocab(args.vocab_cache)
    tokens = grammar_tokens(vocab)
    for name in args.engines.split(","):
        run_engine(name, vocab, tokens, args)


if __name__ == "__main__":
    main()
