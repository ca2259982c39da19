"""Scheduler: hands out one step's token budget; no prefill or decode phases.

Each step, running requests go first (in arrival order), each asking for the tokens it still lacks
(one for a decode, a chunk for a prefill), then waiting requests join while budget, sequence slots and KV
blocks last. When a running request can't get a block, the newest running request is preempted: its blocks
are freed and it recomputes later (recompute, not swap; recompute is cheap next to CPU memory traffic).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from serval.config import SchedulerConfig
from serval.engine.batch_rows import BatchRows
from serval.engine.block_manager import BlockManager
from serval.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request]  # scheduled this step, in batch order
    num_new_tokens: list[int]  # tokens each computes this step
    num_computed_tokens: list[int]  # KV-cached tokens of each before this step
    preempted: list[Request]  # pushed back to waiting this step

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # The running requests' block tables, a row each (batch_rows.py): a row lives as long as its
        # request runs, so it is given back on every way out of `running`.
        self.rows = BatchRows(-(-max_model_len // block_manager.block_size))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request that already holds blocks (a fork of a running one) straight into the batch."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput([], [], [], [])
        scheduled: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # Its next input and any speculative drafts (engine/speculation/), as far as the budget goes.
            num_new = min(request.num_tokens_with_drafts - request.num_computed_tokens, budget)
            if num_new == 0:
                index += 1  # a beam that reported and waits for its group's choice (engine/beam_search.py)
                continue
            if request.draft_token_ids:
                request.keep_drafts(num_new)
            # Most decode steps write into a block the request already holds alone: nothing to allocate.
            if not self.block_manager.fits_in_place(request, num_new):
                if not self._make_room(request, num_new, out, scheduled):
                    continue  # the request itself was preempted; the list shrank under it
                self.block_manager.allocate(request, num_new)
            self._add_to_output(out, request, num_new)
            scheduled.add(request.request_id)
            budget -= num_new
            index += 1
        # A step that had to preempt admits nobody new: memory is already short.
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            if not self.block_manager.can_allocate(request, num_new, cached):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                self.block_manager.record_query(request.num_prompt_tokens)
                request.num_cached_tokens = num_cached_tokens
            self.block_manager.allocate(request, num_new, cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_output(out, request, num_new)
            budget -= num_new
        return out

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput, scheduled: set[str]) -> bool:
        """Preempt from the back of the running list until `request` fits; False if it was the victim."""
        while not self.block_manager.can_allocate(request, num_new):
            victim = self._pick_victim(scheduled)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _pick_victim(self, scheduled: set[str]) -> Request:
        # The newest running request not already given tokens this step (their inputs are in the batch).
        for request in reversed(self.running):
            if request.request_id not in scheduled:
                return request
        raise AssertionError("no running request left to preempt")

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.rows.release(request)
        self.block_manager.free(request)
        request.clear_drafts()
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.num_computed_tokens.append(request.num_computed_tokens)

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.rows.release(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.media_prompt = None  # its encoder state and positions go with it (a fork may still hold them)
