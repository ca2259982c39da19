"""serval: an LLM inference server with a paged KV cache, continuous batching and an OpenAI-compatible API."""

from serval.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model stack; import it only when asked for.
    if name == "LLM":
        from serval.llm import LLM

        return LLM
    raise AttributeError(name)
