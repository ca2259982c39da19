"""serval: an LLM inference server with a paged KV cache, continuous batching and an OpenAI-compatible API."""

import os

# NOTE: set here, before anything of serval imports torch: PyTorch reads THP_MEM_ALLOC_ENABLE once, at its
# first CPU allocation. With it, tensors of 2 MB and more (the packed weights, the KV cache) are 2 MB-aligned
# and advised for transparent huge pages where the kernel allows them (`madvise` or `always`): a batch-1
# decode streams every weight once a token, and with 4 KB pages it takes a TLB miss every 4 KB. Measured on
# a 1B Q4_0 model: decode 14% faster, load 0.9 s shorter (docs/benchmarks/2026-12-03.md). A user's own
# setting wins; where torch was imported before serval, its allocator keeps whatever it read then.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from serval.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model stack; import it only when asked for.
    if name == "LLM":
        from serval.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
