"""Grammar compiles are bounded in time and memory, on the default model's vocabulary (where a compile's cost
is real; the byte tokenizer's 258 tokens make every schema cheap): a compile past its deadline or its memory
cap is a 400 naming the parameter, its worker process is killed and replaced, and other compiles neither wait
for it nor fail."""

from __future__ import annotations

import asyncio
import time

import pytest

from serval.model_source import resolve_model
from serval.serving.errors import InvalidRequestError
from serval.serving.grammar_pool import GrammarLimits
from serval.serving.structured import MAX_SCHEMA_DEPTH, GrammarCompiler, check_schema
from serval.serving.tokenizer import Tokenizer

# Found by measurement on the default vocabulary, one core each. SLOW: a counted repetition of a counted
# class, ~17-20 s on a Zen 4 EPYC and longer on a Zen 2 (its former {1,50} inner count took 8.3 s on the Zen 4,
# under the 10 s server deadline that tests/e2e/test_grammar_limits.py needs it to miss). HUNGRY: ~1.6 s and ~220 MB (200 properties with a nested counted
# pattern; memory grows linearly with them).
SLOW = {"type": "string", "pattern": "^([a-z0-9]{1,100}[-_.]){1,100}$"}
HUNGRY = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "pattern": "^(([a-z]{1,20}),){1,10}$"} for i in range(200)},
}
NORMAL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


def schema_spec(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema, "strict": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


async def outcome(compiler: GrammarCompiler, name: str, spec: dict, param: str, finished: list) -> None:
    try:
        await compiler.compile(spec, param)
        finished.append((name, None))
    except InvalidRequestError as e:
        finished.append((name, e))


def test_a_compile_past_its_deadline_is_killed_and_others_go_on(tokenizer):
    compiler = GrammarCompiler(tokenizer, GrammarLimits(timeout_s=3.0, num_workers=2))

    async def run() -> None:
        await compiler.compile({"type": "json_object"}, "response_format")  # starts the workers
        finished: list = []
        slow = asyncio.create_task(outcome(compiler, "slow", schema_spec(SLOW), "response_format", finished))
        deadline = time.monotonic() + 60  # a bound on a failure: taking a free worker is quick
        while compiler.num_busy_workers < 1:  # until the slow one holds a worker
            assert time.monotonic() < deadline, "the slow compile never took a worker"
            await asyncio.sleep(0.01)  # a poll interval
        await outcome(compiler, "normal", schema_spec(NORMAL), "response_format", finished)
        await slow
        # The normal compile was answered while the slow one was still running in the other worker.
        assert [name for name, _ in finished] == ["normal", "slow"]
        assert finished[0][1] is None
        error = finished[1][1]
        assert error.param == "response_format"
        assert "did not compile within 3 s" in str(error)
        # The killed worker was replaced at once; both workers serve new grammars.
        assert compiler.num_live_workers == 2
        more = [{**NORMAL, "required": ["name"]}, {**NORMAL, "required": ["age"]}]
        await asyncio.gather(*(compiler.compile(schema_spec(s), "response_format") for s in more))
        # The same slow schema again is refused at once, from memory, without tying up a worker.
        start = time.monotonic()
        with pytest.raises(InvalidRequestError, match="did not compile within 3 s") as refused:
            await compiler.compile(schema_spec(SLOW), "tools")
        assert refused.value.param == "tools"
        assert time.monotonic() - start < 3.0

    try:
        asyncio.run(run())
    finally:
        compiler.shutdown()


def test_one_worker_is_replaced_so_the_next_compile_does_not_wait(tokenizer):
    # With a thread in place of the process, the one worker would stay busy with SLOW for another ~15 s or more and
    # the next compile would miss its own deadline.
    compiler = GrammarCompiler(tokenizer, GrammarLimits(timeout_s=3.0, num_workers=1))

    async def run() -> None:
        with pytest.raises(InvalidRequestError, match="did not compile within"):
            await compiler.compile(schema_spec(SLOW), "response_format")
        grammar = await compiler.compile(schema_spec(NORMAL), "response_format")
        assert grammar.new_constraint().allowed_token_bitmask() is not None
        assert compiler.num_live_workers == 1

    try:
        asyncio.run(run())
    finally:
        compiler.shutdown()


def test_requests_for_the_same_new_spec_share_one_check(tokenizer):
    # One worker: were each request to take the worker in turn, the later ones would wait past the deadline
    # for it (429) or be refused seconds later; the one check answers them all.
    compiler = GrammarCompiler(tokenizer, GrammarLimits(timeout_s=3.0, num_workers=1))

    async def run() -> list:
        finished: list = []
        await asyncio.gather(
            *(outcome(compiler, f"r{i}", schema_spec(SLOW), "response_format", finished) for i in range(4))
        )
        return finished

    try:
        finished = asyncio.run(run())
    finally:
        compiler.shutdown()
    assert len(finished) == 4
    assert all("did not compile within 3 s" in str(error) for _, error in finished)


def test_a_compile_past_its_memory_cap_is_a_400(tokenizer):
    compiler = GrammarCompiler(tokenizer, GrammarLimits(timeout_s=60.0, memory_bytes=64 << 20, num_workers=1))

    async def run() -> None:
        with pytest.raises(InvalidRequestError, match="needs more than 64 MiB to compile") as refused:
            await compiler.compile(schema_spec(HUNGRY), "tools")
        assert refused.value.param == "tools"
        # The worker that ran out was replaced; the next grammar compiles.
        assert compiler.num_live_workers == 1
        await compiler.compile(schema_spec(NORMAL), "response_format")

    try:
        asyncio.run(run())
    finally:
        compiler.shutdown()


def test_schema_errors_come_back_from_the_worker(tokenizer):
    compiler = GrammarCompiler(tokenizer, GrammarLimits(timeout_s=30.0, num_workers=1))
    spec = schema_spec({"type": "string", "pattern": "(unclosed"})
    try:
        with pytest.raises(InvalidRequestError, match="cannot be compiled into a grammar") as refused:
            asyncio.run(compiler.compile(spec, "response_format"))
        assert refused.value.param == "response_format"
        assert compiler.num_live_workers == 1  # a refusal is not a reason to replace the worker
    finally:
        compiler.shutdown()


def test_schemas_nested_too_deep_are_refused_before_compiling():
    schema: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    check_schema(schema, "response_format")  # at the limit
    with pytest.raises(InvalidRequestError, match=f"deeper than {MAX_SCHEMA_DEPTH} levels") as refused:
        check_schema({"type": "object", "properties": {"a": schema}}, "response_format")
    assert refused.value.param == "response_format"


def test_a_worker_killed_while_idle_is_replaced_before_its_next_compile():
    # The kernel's OOM killer or an operator may kill an idle worker; the next compile must not fail for it.
    import multiprocessing
    import os
    import signal

    from tests.serving.fakes import ByteTokenizer

    compiler = GrammarCompiler(ByteTokenizer(), GrammarLimits(timeout_s=30.0, num_workers=1))
    others = {p.pid for p in multiprocessing.active_children()}  # other compilers' workers, not yet collected
    try:
        asyncio.run(compiler.compile(schema_spec(NORMAL), "response_format"))
        [worker] = [p for p in multiprocessing.active_children() if p.pid not in others]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        asyncio.run(compiler.compile(schema_spec({**NORMAL, "required": ["age"]}), "response_format"))
        assert compiler.num_live_workers == 1
    finally:
        compiler.shutdown()
