"""BatchRows: the scheduled requests' persistent rows always read as their block lists, through joins,
decodes across block boundaries, preemption (blocks freed, recomputed into others), copy on write of a
forked block, finishing and the rows' reuse, with more requests than the first rows hold."""

from __future__ import annotations

import random

from serval.config import SchedulerConfig
from serval.engine.block_manager import BlockManager
from serval.engine.request import Request
from serval.engine.scheduler import Scheduler
from serval.sampling import SamplingParams


def _assert_rows_match(scheduler: Scheduler, requests: list[Request]) -> None:
    tables = scheduler.rows.step_tables(requests)
    for row, request in zip(tables.tolist(), requests):
        assert row[: len(request.block_ids)] == request.block_ids


def _run(scheduler: Scheduler, steps: int, rng: random.Random) -> int:
    """Schedule and complete steps as the engine would, checking the rows each step; the preemptions seen."""
    num_preempted = 0
    for _ in range(steps):
        out = scheduler.schedule()
        num_preempted += len(out.preempted)
        if out.is_empty:
            break
        _assert_rows_match(scheduler, out.requests)
        for request, num_new in zip(out.requests, out.num_new_tokens):
            request.num_computed_tokens += num_new
            scheduler.block_manager.cache_full_blocks(request)
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(rng.randrange(1000))
                if request.num_output_tokens >= request.params.max_tokens:
                    scheduler.finish(request)
        assert scheduler.rows.num_in_use == len(scheduler.running)
    return num_preempted


def test_rows_follow_block_lists_through_decodes_preemption_and_reuse():
    rng = random.Random(0)
    config = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=64)
    # A cache too small for every request's whole answer: the newest ones are preempted and recomputed.
    scheduler = Scheduler(config, BlockManager(48, 4), max_model_len=256)
    for i in range(40):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        scheduler.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30)), ()))
    assert _run(scheduler, 2000, rng) > 0  # the test covers preemption
    assert scheduler.num_unfinished == 0 and scheduler.rows.num_in_use == 0
    assert scheduler.rows.tables.shape[0] >= 16


def test_a_copied_block_replaces_the_shared_one_in_the_row():
    rng = random.Random(1)
    bm = BlockManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), bm, max_model_len=64)
    parent = Request("p", list(range(6)), SamplingParams(max_tokens=8), ())
    scheduler.add(parent)
    _run(scheduler, 1, rng)  # the prompt computed, one token sampled
    child = Request("c", parent.token_ids[:], SamplingParams(max_tokens=8), ())
    bm.fork(parent, child, parent.num_computed_tokens)  # shares the half-full second block
    scheduler.add_running(child)
    shared = child.block_ids[1]
    out = scheduler.schedule()
    # The parent, scheduled first, writes into the shared block first: copy on write gives it a copy in
    # place of the block its row already holds.
    assert out.requests == [parent, child] and parent.block_ids[1] != shared == child.block_ids[1]
    _assert_rows_match(scheduler, out.requests)
