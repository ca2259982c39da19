"""Scheduler: token budget, chunked prefill, admission limits and preemption, on token ids alone."""

from __future__ import annotations

from serval.config import SchedulerConfig
from serval.engine.block_manager import BlockManager
from serval.engine.request import Request, RequestStatus
from serval.engine.scheduler import Scheduler
from serval.sampling import SamplingParams


def _scheduler(num_blocks=16, block_size=4, budget=8, max_num_seqs=4) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(num_blocks, block_size), max_model_len=1024)


def _complete_step(scheduler: Scheduler, out, sampled_token: int = 1) -> None:
    """Pretend the runner computed the step: advance counters and sample where the context completed."""
    for request, num_new in zip(out.requests, out.num_new_tokens):
        request.num_computed_tokens += num_new
        scheduler.block_manager.cache_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(sampled_token)


def test_long_prompt_is_chunked_by_the_budget():
    s = _scheduler(budget=8)
    r = Request("a", list(range(20)), SamplingParams(), ())
    s.add(r)
    sizes = []
    for _ in range(3):
        out = s.schedule()
        sizes.append(out.num_new_tokens[0])
        _complete_step(s, out)
    assert sizes == [8, 8, 4]
    assert r.num_output_tokens == 1


def test_new_requests_join_running_ones_in_the_same_step():
    s = _scheduler(budget=8)
    a = Request("a", list(range(5)), SamplingParams(), ())
    s.add(a)
    _complete_step(s, s.schedule())
    b = Request("b", list(range(100, 110)), SamplingParams(), ())
    s.add(b)
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new_tokens == [1, 7]  # a decodes, b's prefill takes the rest of the budget


def test_max_num_seqs_limits_admission():
    s = _scheduler(budget=64, max_num_seqs=2)
    for i in range(3):
        s.add(Request(str(i), [i, i + 1], SamplingParams(), ()))
    out = s.schedule()
    assert len(out.requests) == 2 and len(s.waiting) == 1


def test_preemption_frees_the_newest_and_it_recomputes_later():
    # 4 blocks of 2 tokens: two requests of 3 tokens take 2 blocks each; growing needs a fifth block.
    s = _scheduler(num_blocks=4, block_size=2, budget=16)
    a = Request("a", [1, 2, 3], SamplingParams(), ())
    b = Request("b", [4, 5, 6], SamplingParams(), ())
    s.add(a)
    s.add(b)
    _complete_step(s, s.schedule())  # both prefilled; each now has 4 tokens, 3 computed
    _complete_step(s, s.schedule())  # decode: the 4th token fits the second block
    out = s.schedule()  # 5th token of a needs a new block: b is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert [r.request_id for r in out.requests] == ["a"]
    s.finish(a)
    out = s.schedule()
    assert out.requests == [b]
    # b recomputes prompt + its outputs, minus what the prefix cache still holds.
    assert b.num_computed_tokens + out.num_new_tokens[0] == b.num_tokens


def test_finish_frees_blocks_of_waiting_and_running_requests():
    s = _scheduler()
    a = Request("a", list(range(6)), SamplingParams(), ())
    b = Request("b", list(range(6)), SamplingParams(), ())
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a)
    s.finish(b)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert s.num_unfinished == 0
