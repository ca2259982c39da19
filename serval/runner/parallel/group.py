"""The tensor-parallel ranks' channels: process groups over torch.distributed, and each step's Batch on them.

Owns two things every rank agrees on. The groups: a gloo group on the CPU (the step's batch always travels on
it; on the CPU it also carries the all-reduces) and, where the device is CUDA, an NCCL group for the
all-reduces. The wire form of a Batch: rank 0 broadcasts what a worker needs to run the model (token ids,
positions, block tables, block copies) as one int64 tensor behind a two-int header; sampling stays on rank 0,
so the per-request parts (SamplingRow, generators, grammar bitmasks) never travel.

Groups are objects built from a TCPStore, not torch.distributed's default group: no process-wide state, so a
process (a test) may hold several groups one after the other.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from serval.runner.batch import Batch

_STOP, _STEP = 0, 1
# How long a worker waits for rank 0's next batch: an idle server sends none for hours. Rank 0 going away is
# seen at once anyway (its connections close), and the worker also watches its parent (parallel/worker.py).
_IDLE_WAIT = datetime.timedelta(days=365)
HOST = "127.0.0.1"  # every rank runs on this machine


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta):
    """A gloo group over loopback. timeout: how long a collective (an all-reduce) waits for the other ranks."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # On loopback whatever the host name resolves to (a container's may not resolve at all).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def compute_group(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, device, cpu_group
):
    """The group the all-reduces run on: NCCL for CUDA tensors, else the gloo group itself.

    NOTE: the NCCL path is untested (no GPU where serval's tests run); it follows torch.distributed's API.
    """
    if device.type != "cuda":
        return cpu_group
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)


def all_reduce(group, tensor: torch.Tensor) -> None:
    """Sum `tensor` over the ranks, in place."""
    group.allreduce([tensor]).wait()


def send_batch(group, batch: Batch) -> None:
    """Rank 0: send the step to every worker."""
    payload = encode_batch(batch)
    header = torch.tensor([_STEP, payload.numel()], dtype=torch.int64)
    _broadcast(group, header)
    _broadcast(group, payload)


def send_stop(group) -> None:
    _broadcast(group, torch.tensor([_STOP, 0], dtype=torch.int64))


def receive_batch(group) -> Batch | None:
    """A worker: the next step's batch (as much of it as the model needs), or None when rank 0 stops."""
    header = torch.empty(2, dtype=torch.int64)
    _broadcast(group, header, _IDLE_WAIT)
    command, length = header.tolist()
    if command == _STOP:
        return None
    payload = torch.empty(length, dtype=torch.int64)
    _broadcast(group, payload)
    return decode_batch(payload)


def _broadcast(group, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    if timeout is not None:
        options.timeout = timeout
    group.broadcast([tensor], options).wait()


def encode_batch(batch: Batch) -> torch.Tensor:
    """[num_seqs, num_copies, num_new..., num_computed..., table lengths..., token ids..., tables..., copies...]"""
    tables = batch.block_tables
    if isinstance(tables, torch.Tensor):  # the engine's gathered rows: whole rows cross, padding included
        tables = tables.tolist()
    values = [batch.num_seqs, len(batch.block_copies)]
    values += batch.num_new_tokens
    values += batch.num_computed_tokens
    values += [len(table) for table in tables]
    values += batch.token_ids
    for table in tables:
        values += table
    for source, destination in batch.block_copies:
        values += (source, destination)
    return torch.tensor(values, dtype=torch.int64)


def decode_batch(payload: torch.Tensor) -> Batch:
    values = payload.tolist()
    num_seqs, num_copies = values[0], values[1]
    at = 2

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return values[at - n : at]

    num_new = take(num_seqs)
    num_computed = take(num_seqs)
    table_lengths = take(num_seqs)
    token_ids = take(sum(num_new))
    tables = [take(n) for n in table_lengths]
    copies = take(2 * num_copies)
    return Batch(
        token_ids=token_ids,
        num_new_tokens=num_new,
        num_computed_tokens=num_computed,
        block_tables=tables,
        sample_indices=[],  # workers compute no logits: rank 0 alone runs the head and samples
        sampling=[],
        block_copies=list(zip(copies[0::2], copies[1::2])),
    )
