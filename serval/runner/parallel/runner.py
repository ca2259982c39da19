"""TensorParallelRunner: rank 0 of a model split over N processes, in the engine's place of a ModelRunner.

Owns the workers' lives and the step protocol. At start it spawns ranks 1..N-1 (parallel/worker.py), loads
its own shard meanwhile (a ModelRunner with a TensorParallelPart), waits until every worker reports its shard
loaded (or refuses with the first worker's reason), and joins the process groups. Each step it broadcasts
the Batch (parallel/group.py) and then runs its own shard, whose all-reduces meet the workers'; the head and
the sampler run here alone, on whole logits (embedding and head are replicated: sampling needs every logit,
and the head is one matmul that a vocabulary split would trade for a gather of the logits each step).

A worker that dies is seen by a watch thread (its process sentinel) or by the next collective (gloo fails as
soon as a peer's connection closes; a hung peer fails it after collective_timeout_s): the runner logs one
clear line, refuses every later step, and calls the callback given to `watch` (the server stops itself).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serval.config import CacheConfig, LoraConfig, ModelConfig, ParallelConfig
from serval.model_source import ModelSource
from serval.runner.batch import Batch
from serval.runner.loader.load import open_checkpoint
from serval.runner.parallel.group import HOST, all_reduce, compute_group, gloo_group, send_batch, send_stop
from serval.runner.parallel.shard import TensorParallelPart, plan_shard
from serval.runner.parallel.worker import WorkerArgs, worker_main
from serval.runner.placement import resolve_device
from serval.runner.runner import ModelRunner

logger = logging.getLogger(__name__)

_STOP_WAIT_S = 10.0  # how long close() lets a worker exit on its own before killing it


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: the split model cannot run another step."""


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        source: ModelSource,
        lora_config: LoraConfig | None,
        parallel_config: ParallelConfig,
    ):
        world_size = parallel_config.tensor_parallel_size
        # What cannot be split is refused before any process starts (reading the checkpoint's shape is cheap:
        # loader/gguf_file.py reads a GGUF's directory without its tensors).
        arch = open_checkpoint(source).arch
        ModelRunner.check_can_split(arch, lora_config)
        plan_shard(arch, 0, world_size)
        self.failure: str | None = None
        self._on_failure = None
        self._groups: dict[str, object] = {}
        timeout = datetime.timedelta(seconds=parallel_config.collective_timeout_s)
        # The rendezvous of the groups; port 0: the OS picks a free one.
        store = dist.TCPStore(HOST, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        num_threads = parallel_config.threads_per_rank or max(1, torch.get_num_threads() // world_size)
        device = resolve_device(model_config.device)
        context = mp.get_context("spawn")
        self._workers: list[tuple[int, mp.Process]] = []
        pipes = []
        for rank in range(1, world_size):
            worker_model = model_config
            if device.type == "cuda":  # one GPU a rank
                worker_model = _with_device(model_config, f"cuda:{rank}")
            args = WorkerArgs(
                rank, world_size, store.port, worker_model, cache_config, source, num_threads,
                parallel_config.collective_timeout_s,
            )  # fmt: skip
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=worker_main, args=(args, sender), name=f"serval-tp-rank{rank}", daemon=True
            )
            process.start()
            sender.close()
            self._workers.append((rank, process))
            pipes.append(receiver)
        self._stop_watch = context.Pipe(duplex=False)
        self._finalizer = weakref.finalize(self, _close, self._groups, self._workers, self._stop_watch[1])
        try:
            torch.set_num_threads(num_threads)  # this process is rank 0: its share of the cores
            part = TensorParallelPart(0, world_size, lambda t: all_reduce(self._groups["compute"], t))
            super().__init__(model_config, cache_config, source, lora_config, part)
            self._wait_until_loaded(pipes)
            self._groups["cpu"] = gloo_group(store, 0, world_size, timeout)
            self._groups["compute"] = compute_group(
                store, 0, world_size, timeout, self.device, self._groups["cpu"]
            )
        except BaseException:
            self.close()
            raise
        logger.info(
            "tensor parallel: %d ranks, %d threads each, workers' pids %s",
            world_size, num_threads, [process.pid for _, process in self._workers],
        )  # fmt: skip
        threading.Thread(target=self._watch_workers, name="serval-tp-watch", daemon=True).start()

    def _wait_until_loaded(self, pipes) -> None:
        """Until every worker has its shard: ValueError with a worker's own reason if one could not load."""
        waiting = dict(zip(pipes, self._workers))
        while waiting:
            for ready in wait([*waiting, *(process.sentinel for _, process in waiting.values())]):
                if ready not in waiting:  # a sentinel: a process ended without a word (killed)
                    rank, process = next(w for w in waiting.values() if w[1].sentinel == ready)
                    raise ValueError(
                        f"tensor-parallel worker rank {rank} exited with {process.exitcode} while loading"
                    )
                rank, _ = waiting.pop(ready)
                try:
                    status, detail = ready.recv()
                except EOFError:
                    raise ValueError(f"tensor-parallel worker rank {rank} exited while loading") from None
                if status != "ready":
                    raise ValueError(f"tensor-parallel worker rank {rank} could not load its shard: {detail}")

    def _watch_workers(self) -> None:
        stop = self._stop_watch[0]
        sentinels = {process.sentinel: (rank, process) for rank, process in self._workers}
        ready = wait([stop, *sentinels])
        if stop in ready or self._finalizer.alive is False:
            return
        rank, process = sentinels[next(r for r in ready if r in sentinels)]
        process.join(timeout=1)
        self._fail(
            f"tensor-parallel worker rank {rank} (pid {process.pid}) died with exit code {process.exitcode}; "
            "the split model cannot run: stopping"
        )

    def _fail(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        logger.error("%s", message)
        if self._on_failure is not None:
            self._on_failure(message)

    def watch(self, on_failure) -> None:
        self._on_failure = on_failure
        if self.failure is not None:
            on_failure(self.failure)

    @torch.inference_mode()
    def compute_logits(self, batch: Batch) -> torch.Tensor:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            send_batch(self._groups["cpu"], batch)
            return super().compute_logits(batch)
        except RuntimeError as e:  # gloo: a peer's connection closed, or a collective timed out
            self._fail(f"a tensor-parallel collective failed ({e}); the split model cannot run: stopping")
            raise TensorParallelError(self.failure) from e

    def close(self) -> None:
        """Stop the workers (asking first) and release the groups; safe to call more than once."""
        self._finalizer()


def _close(groups: dict, workers: list, stop_watch) -> None:
    # A function of the parts, not a method: the finalizer must not keep the runner alive.
    stop_watch.send(None)
    cpu_group = groups.pop("cpu", None)
    if cpu_group is not None:
        try:
            if all(process.is_alive() for _, process in workers):
                send_stop(cpu_group)
        except RuntimeError:
            pass
    for _, process in workers:
        process.join(timeout=_STOP_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()
    # NOTE: shut down explicitly: a gloo group left to the interpreter's teardown with a dead peer aborts it.
    compute = groups.pop("compute", None)
    for group in (compute if compute is not cpu_group else None, cpu_group):
        if group is not None:
            try:
                group.shutdown()
            except RuntimeError:
                pass


def _with_device(config: ModelConfig, device: str) -> ModelConfig:
    return dataclasses.replace(config, device=device)


def make_runner(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    source: ModelSource,
    lora_config: LoraConfig | None = None,
    parallel_config: ParallelConfig | None = None,
) -> ModelRunner:
    """The engine's runner: one process, or rank 0 of a split over parallel_config.tensor_parallel_size."""
    if parallel_config is None or parallel_config.tensor_parallel_size == 1:
        return ModelRunner(model_config, cache_config, source, lora_config)
    return TensorParallelRunner(model_config, cache_config, source, lora_config, parallel_config)
