"""The offline LLM is a synchronous client of the server's pipeline: it works the same called from inside a
running event loop (a Jupyter cell runs one), where `asyncio.run` would fail, and leaves nothing running."""

from __future__ import annotations

import asyncio

from serval import LLM, SamplingParams

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say something."}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _answers(llm: LLM) -> tuple[list[int], list[int]]:
    [generated] = llm.generate([PROMPT], PARAMS)
    [chatted] = llm.chat(MESSAGES, PARAMS)
    return generated.outputs[0].token_ids, chatted.outputs[0].token_ids


def test_generate_and_chat_inside_a_running_event_loop(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama")[0], dtype="float32", num_kv_blocks=64)
    try:
        outside = _answers(llm)

        async def inside() -> tuple[list[int], list[int]]:
            assert asyncio.get_running_loop().is_running()
            return _answers(llm)

        assert asyncio.run(inside()) == outside
        assert [len(ids) for ids in outside] == [PARAMS.max_tokens] * 2
        engine = llm.engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.close()


def test_a_stop_string_leaves_nothing_running_when_the_call_returns(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama")[0], dtype="float32", num_kv_blocks=64)
    try:
        [free] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        text = free.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        [cut] = llm.generate(
            [PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
        )
        assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
        # The engine request was aborted at the stop string (its blocks freed) before generate returned.
        engine = llm.engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        llm.close()
