"""BatchRows: the running requests' block tables in one preallocated tensor, a row each, updated in place.

A request takes a row the first time it is scheduled and gives it back when it leaves the running set
(finished, aborted or preempted: the scheduler says so). The block manager notes from which index a
request's block list changed (`Request.block_ids_changed_from`); before each step the scheduled requests'
rows catch up from there: for a decode, nothing on most steps and one id when it crosses into a new block;
the whole row only when a request (re)joins. The step's block tables are then one gather of those rows,
instead of a list of lists copied, padded and converted every step (vLLM's BlockTable does the same).
"""

from __future__ import annotations

import torch

from serval.engine.request import Request


class BatchRows:
    def __init__(self, max_blocks_per_seq: int, num_rows: int = 16):
        # Rows grow by doubling as more requests run at once; columns hold the longest context the engine
        # accepts. Entries past a request's blocks are never read (attention reads a sequence's context
        # only), so a row is cleared when taken, not when its request's list shrinks.
        self.tables = torch.zeros((num_rows, max_blocks_per_seq), dtype=torch.long)
        self.free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest row first

    @property
    def num_in_use(self) -> int:
        return self.tables.shape[0] - len(self.free_rows)

    def step_tables(self, requests: list[Request]) -> torch.Tensor:
        """(len(requests), max_blocks) int64: each request's blocks in order, then ids nothing reads."""
        rows, max_blocks = [], 0
        for request in requests:
            if request.batch_row is None:
                request.batch_row = self._take_row()
                request.block_ids_changed_from = 0
            if request.block_ids_changed_from is not None:
                self._write(request)
            rows.append(request.batch_row)
            max_blocks = max(max_blocks, len(request.block_ids))
        return self.tables[torch.tensor(rows), :max_blocks]

    def release(self, request: Request) -> None:
        """The request left the running set: its row is free (a request that rejoins is written whole)."""
        if request.batch_row is not None:
            self.free_rows.append(request.batch_row)
            request.batch_row = None

    def _write(self, request: Request) -> None:
        start = request.block_ids_changed_from
        new_ids = request.block_ids[start:]
        if new_ids:
            self.tables[request.batch_row, start : start + len(new_ids)] = torch.tensor(new_ids)
        request.block_ids_changed_from = None

    def _take_row(self) -> int:
        if not self.free_rows:
            num_rows = self.tables.shape[0]
            self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
            self.free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self.free_rows.pop()
        self.tables[row].zero_()
        return row
