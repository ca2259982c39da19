"""The CUDA-only part of decode graphs (decode_graphs.py): when a runner uses them, and capturing one forward
as a torch.cuda.CUDAGraph.

Kept to this so that everything around the capture (buckets, static buffers, padding) runs and is tested on
any device with `decode_graphs.replay_eagerly` in its place. Checked on a GPU by bench/gpu/.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def decode_graphs_for(runner, max_batch: int, lora_config, tensor_parallel):
    """The runner's DecodeGraphs, or None where decode runs eagerly. Graphs are used on CUDA with the Triton
    backend (its metadata is what the static buffers hold), up to max_batch sequences
    (ModelConfig.cuda_graph_max_batch; 0: never), for a dense text-only model (a mixture of experts routes on
    the host) in one process without LoRA adapters. Its padding rows use the block past the engine's."""
    if not (
        runner.device.type == "cuda"
        and max_batch > 0
        and runner.attention_backend.name == "triton"
        and runner.arch.moe is None
        and not runner.accepts_media
        and tensor_parallel is None
        and not (lora_config is not None and lora_config.is_enabled)
    ):
        return None
    from serval.runner.decode_graphs import DecodeGraphs  # imports triton

    max_blocks_per_seq = -(-runner.max_model_len // runner.block_size)
    return DecodeGraphs(
        runner.model, runner.kv_caches, runner.block_size, max_blocks_per_seq, max_batch,
        pad_block=runner.num_blocks, device=runner.device, capture=CudaGraphCapture(),
    )  # fmt: skip


class CudaGraphCapture:
    """A `decode_graphs.Capture` whose graphs share one memory pool (see decode_graphs.py's NOTE)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # A warm-up run on a side stream first: Triton compiles its kernels and cuBLAS makes its workspace
        # on first use, neither of which may happen inside a capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
