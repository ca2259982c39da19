"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shard, then run every step rank 0 sends.

Owns the worker's life. It is started with torch.multiprocessing's spawn method (a fresh interpreter: no
forked copy of rank 0's threads or OpenMP pool) by parallel/runner.py, reports once on its pipe whether its
shard loaded ("ready", or "error" and why), joins the process groups, then loops: receive the step's batch,
run the model over it (its all-reduces meet rank 0's), until rank 0 says stop. It exits when rank 0 goes away:
a collective fails as the connections close, and a watchdog thread sees the parent process change.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from serval.config import CacheConfig, ModelConfig
from serval.model_source import ModelSource

_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker needs, pickled to the spawned process."""

    rank: int
    world_size: int
    store_port: int  # rank 0's TCPStore, for the groups' rendezvous
    model: ModelConfig
    cache: CacheConfig  # with num_blocks fixed by rank 0, so every rank's KV cache has the same blocks
    source: ModelSource
    num_threads: int
    timeout_s: float  # a collective's limit


def worker_main(args: WorkerArgs, conn) -> None:
    """The spawned process's entry point (a module-level function, so spawn can import it)."""
    import torch.distributed as dist

    from serval.runner.parallel.group import HOST, all_reduce, compute_group, gloo_group, receive_batch
    from serval.runner.parallel.shard import TensorParallelPart
    from serval.runner.runner import ModelRunner

    _exit_with_parent(os.getppid())
    torch.set_num_threads(args.num_threads)
    groups: dict[str, object] = {}
    try:
        runner = ModelRunner(
            args.model,
            args.cache,
            args.source,
            tensor_parallel=TensorParallelPart(
                args.rank, args.world_size, lambda t: all_reduce(groups["compute"], t)
            ),
        )
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which refuses to start with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        conn.close()
        sys.exit(1)
    conn.send(("ready", None))
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore(HOST, args.store_port, args.world_size, False, timeout=timeout)
    groups["cpu"] = gloo_group(store, args.rank, args.world_size, timeout)
    groups["compute"] = compute_group(
        store, args.rank, args.world_size, timeout, runner.device, groups["cpu"]
    )
    try:
        while (batch := receive_batch(groups["cpu"])) is not None:
            runner.compute_logits(batch)
    except BaseException:  # noqa: BLE001 - rank 0 sees the exit; the traceback goes to the shared stderr
        print(f"serval tensor-parallel worker rank {args.rank} stopped:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(
            1
        )  # NOTE: not sys.exit: a group with a broken peer aborts the interpreter as it is torn down
    groups["cpu"].shutdown()
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    """A daemon thread that ends the process once rank 0 is gone (its connections closing usually tell first,
    but a worker waiting in a load or a step would not notice them)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="serval-tp-parent-watch", daemon=True).start()
