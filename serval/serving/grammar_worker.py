"""The child side of the grammar gate: one xgrammar compile per request, in a process that may be killed.

Owns what runs inside a grammar worker process (serving/grammar_pool.py starts and kills them) and the one
compile function the worker and the server share (`compile_spec`), so that the gate tries exactly the compile
the server will then do. A worker builds its own xgrammar compiler from the server's grammar vocabulary (GrammarVocabulary),
caps its own address space, tells the parent it is ready, then answers one spec at a time
until the pipe closes. It keeps nothing: the compiled grammar is dropped once its size and time are known.

Protocol (tuples over a multiprocessing Pipe): parent -> child `spec`; child -> parent ("ready", None) once,
then per spec ("ok", None), ("invalid", reason), ("memory", None) or ("error", text) (a bug). After "memory" the worker exits: its heap
may be fragmented, and a fresh one costs a fork.

Importing this module imports xgrammar (and so torch) and nothing of serval: it is the forkserver's preload, so that a new worker
is a fork of a process that has paid for the import but never ran a torch op (no thread pools to inherit).
"""

from __future__ import annotations

import ctypes
import json
import resource
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import xgrammar


@dataclass(frozen=True)
class GrammarVocabulary:
    """What xgrammar's TokenizerInfo is built from, in the server and in each worker (plain values: they
    cross to a worker pickled, and both sides build the same TokenizerInfo from them)."""

    # Each token's bytes; b"" marks a token that is never part of a grammar's text.
    token_bytes: list[bytes]
    vocab_size: int
    stop_token_ids: list[int]

    def tokenizer_info(self) -> xgrammar.TokenizerInfo:
        return xgrammar.TokenizerInfo(
            self.token_bytes,
            xgrammar.VocabType.RAW,
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids,
        )


class CompileError(ValueError):
    """xgrammar refused the spec; the message is its reason (one line)."""


def compile_spec(
    compiler: xgrammar.GrammarCompiler, spec: dict[str, Any], max_whitespace: int
) -> xgrammar.CompiledGrammar:
    """spec: {"type": "json_object"}, {"type": "json_schema", "schema": ..., "strict": bool}, or
    {"type": "structural_tag", "format": ...}; max_whitespace: JSON whitespace allowed in a row
    (structured.MAX_WHITESPACE). Raises CompileError (a bad spec) or MemoryError."""
    kind = spec["type"]
    try:
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            return compiler.compile_json_schema(
                json.dumps(spec["schema"]),
                any_whitespace=True,
                strict_mode=bool(spec.get("strict")),
                max_whitespace_cnt=max_whitespace,
            )
        if kind == "structural_tag":
            return compiler.compile_structural_tag(
                json.dumps({"type": "structural_tag", "format": spec["format"]})
            )
    except (RuntimeError, ValueError) as e:
        # xgrammar's messages carry a C++ source location first; the last line is the reason. Under the
        # worker's address-space cap a failed C++ allocation arrives as RuntimeError("std::bad_alloc").
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "bad_alloc" in reason:
            raise MemoryError(reason) from e
        raise CompileError(reason) from e
    raise CompileError(f"unknown grammar type {kind!r}")


def worker_main(
    conn: Connection, vocabulary: GrammarVocabulary, memory_bytes: int, max_whitespace: int
) -> None:
    """A worker process's whole life (the target of grammar_pool's Process)."""
    # Ctrl+C in a terminal reaches the whole process group; the server decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    info = vocabulary.tokenizer_info()
    del vocabulary
    # NOTE: the cache stays on but is emptied after each spec: within one compile it shares the work of
    # repeated parts (200 properties with one pattern: 1.6 s with it, over a minute without), which is what
    # the server's compile does too; across specs nothing may accumulate here.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    # The cap is on top of what the worker already maps (the torch import alone maps ~0.7 GB), so that
    # `memory_bytes` is what one compile may take.
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe or is gone
            return
        try:
            compile_spec(compiler, spec, max_whitespace)
        except MemoryError:
            conn.send(("memory", None))
            return
        except CompileError as e:
            conn.send(("invalid", str(e)))
        except Exception as e:  # noqa: BLE001 - a bug, not the client's: the server answers 500
            conn.send(("error", f"{type(e).__name__}: {e}"))
        else:
            conn.send(("ok", None))
        compiler.clear_cache()
        _return_freed_memory()


def _return_freed_memory() -> None:
    # A large compile leaves glibc holding its freed pages; give them back so an idle worker stays small.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
