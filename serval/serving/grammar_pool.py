"""GrammarPool: worker processes that try each new grammar compile first, under a deadline and a memory cap.

Owns the worker processes (serving/grammar_worker.py is their side) and the limits they enforce. Why
processes: an xgrammar compile runs in C++ and cannot be interrupted, so a compile in a thread that misses its
deadline keeps computing and keeps its thread; two slow schemas then stall every later structured request.
A process is killed at the deadline and replaced, and its own RLIMIT_AS makes a memory-hungry schema fail
there, as a 400, instead of growing the server.

What must hold:
- `check(spec)` is called from at most `num_workers` threads at once (structured.py's executor has that many),
  so a caller always finds an idle worker; each worker serves one spec at a time.
- The deadline counts from the moment the spec is sent to a ready worker: a worker (re)starting is not the
  client's time.
- A worker that missed its deadline, hit its memory cap or died is replaced at once, so the pool is back to
  `num_workers` live processes before the next request needs one.
- NOTE: workers are forked from multiprocessing's forkserver with grammar_worker preloaded, never from the
  server (which holds the engine's torch threads): the forkserver has imported xgrammar and torch but run
  nothing, so a new worker costs a fork, not a two-second import, and its pages are shared. The forkserver
  and its preload list are the stdlib's, one per server process. Like any spawn or forkserver child, a worker
  imports the parent's main module (`serval.entrypoints.cli`: argument parsing, nothing runs), so a script that builds a
  GrammarCompiler keeps its work under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serval.serving.grammar_worker import GrammarVocabulary

# A worker that is not ready this long after its start (the first one waits for the forkserver's imports, on
# a machine busy decoding) is a server fault, not the client's.
START_TIMEOUT_S = 120.0
MIB = 1 << 20


@dataclass(frozen=True)
class GrammarLimits:
    # Seconds one grammar may take to compile in its worker; past it the worker is killed and the request
    # gets a 400 naming its grammar's parameter. (--grammar-compile-timeout)
    timeout_s: float = 10.0
    # Address space one compile may add in its worker (RLIMIT_AS over what the worker maps at rest); past
    # it a 400. (--grammar-compile-memory)
    memory_bytes: int = 1 << 30
    # Worker processes: how many new grammars compile at once. (--grammar-compile-workers)
    num_workers: int = 2

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be positive, got {self.timeout_s}")
        if self.memory_bytes < 16 * MIB:
            raise ValueError(f"the grammar compile memory must be at least 16 MiB, got {self.memory_bytes}")
        if self.num_workers < 1:
            raise ValueError(f"grammar compile workers must be at least 1, got {self.num_workers}")


class GrammarRefused(ValueError):
    """The spec failed in its worker: too slow, too large, refused by xgrammar, or it crashed the worker.
    The message is for the client."""


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(
        self, context: Any, vocabulary: GrammarVocabulary, limits: GrammarLimits, max_whitespace: int
    ):
        from serval.serving.grammar_worker import worker_main

        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=worker_main,
            args=(child_conn, vocabulary, limits.memory_bytes, max_whitespace),
            name="serval-grammar-worker",
            daemon=True,  # multiprocessing kills it when the server exits
        )
        self.process.start()
        child_conn.close()  # the child's copy: with it closed, the child's death is an EOF here
        self.is_ready = False

    def wait_ready(self) -> None:
        if self.is_ready:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"a grammar worker did not start in {START_TIMEOUT_S:g} s")
        try:
            self.conn.recv()  # ("ready", None)
        except (EOFError, OSError):
            self.process.join(5)
            raise RuntimeError(
                f"a grammar worker died at start (exit code {self.process.exitcode})"
            ) from None
        self.is_ready = True

    def stop(self) -> None:
        self.process.kill()  # SIGKILL: a C++ compile does not stop for anything gentler
        self.process.join(5)
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()


class GrammarPool:
    """`num_workers` processes that each try one grammar compile at a time (started on first use)."""

    def __init__(self, vocabulary: GrammarVocabulary, limits: GrammarLimits, max_whitespace: int) -> None:
        self.vocabulary = vocabulary
        self.limits = limits
        self.max_whitespace = max_whitespace
        self._context = multiprocessing.get_context("forkserver")
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: list[_Worker] = []  # every live worker, idle or not (for num_live_workers, close)
        self._lock = threading.Lock()
        self._is_started = False
        self.ready_at: float | None = None  # time.monotonic() when a worker was first ready; None before
        # Workers die with their pool (a test's Frontend), not only with the process.
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    @property
    def num_live_workers(self) -> int:
        with self._lock:
            return sum(worker.process.is_alive() for worker in self._workers)

    @property
    def num_busy_workers(self) -> int:
        """Workers taken for a compile now (what a test waits on before it sends the next one)."""
        return self.limits.num_workers - self._idle.qsize() if self._is_started else 0

    def check(self, spec: dict[str, Any]) -> None:
        """Compile `spec` in a worker within the limits; raise GrammarRefused if it did not. Blocking."""
        self._start()
        try:
            # Never long: callers are at most num_workers threads. Only a pool that lost a worker to a
            # failed restart can run dry.
            worker = self._idle.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError("no grammar worker is left: restarting them failed") from None
        try:
            if not worker.process.is_alive():  # died while idle (the kernel's OOM killer, an operator)
                worker = self._replace(worker)
            worker.wait_ready()
            if self.ready_at is None:
                self.ready_at = time.monotonic()
            worker.conn.send(spec)
            if not worker.conn.poll(self.limits.timeout_s):
                worker = self._replace(worker)
                raise GrammarRefused(
                    f"the grammar did not compile within {self.limits.timeout_s:g} s: simplify the schema"
                )
            try:
                kind, detail = worker.conn.recv()
            except (EOFError, OSError):  # the compile killed its worker (a crash, the kernel's OOM killer)
                worker = self._replace(worker)
                raise GrammarRefused(
                    "compiling the grammar crashed its worker process: simplify the schema"
                ) from None
            if kind == "memory":
                worker = self._replace(worker)
                raise GrammarRefused(
                    f"the grammar needs more than {self.limits.memory_bytes / MIB:g} MiB to compile: "
                    "simplify the schema"
                )
            if kind == "invalid":
                raise GrammarRefused(f"the schema cannot be compiled into a grammar: {detail}")
            if kind == "error":
                raise RuntimeError(f"the grammar worker failed: {detail}")
        except BaseException:
            if not worker.process.is_alive():
                worker = self._replace(worker)
            raise
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        self._finalizer()

    def _start(self) -> None:
        with self._lock:
            if self._is_started:
                return
            self._is_started = True
            # NOTE: preload is a list on the stdlib's one forkserver; every pool sets the same one.
            self._context.set_forkserver_preload(["serval.serving.grammar_worker"])
            for _ in range(self.limits.num_workers):
                worker = self._new_worker()
                self._workers.append(worker)
                self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        # The new worker starts now and gets ready while this request answers its client.
        worker.stop()
        fresh = self._new_worker()
        with self._lock:
            self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _new_worker(self) -> _Worker:
        return _Worker(self._context, self.vocabulary, self.limits, self.max_whitespace)
