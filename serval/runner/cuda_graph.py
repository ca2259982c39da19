"""The CUDA-only part of decode graphs (decode_graphs.py): capturing one forward as a torch.cuda.CUDAGraph.

Kept to this one function so that everything around it (buckets, static buffers, padding) runs and is tested
on any device with `decode_graphs.replay_eagerly` in its place. Checked on a GPU by bench/gpu/.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
