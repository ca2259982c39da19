"""What the server runs, told to its user: the package version and the facts of the served model.

Owns the one list of facts that `GET /version` returns and the `serval_model_info` gauge carries as labels
(model, architecture, weight format, dtype, device, CPU kernel variant, threads, KV-cache and context sizes),
so that a slow or odd answer can be traced to its code path from outside the process.
"""

from __future__ import annotations

import importlib.metadata

from serval.engine.client import RunnerInfo

FALLBACK_VERSION = "0.1.0"  # a source tree run without being installed has no package metadata


def package_version() -> str:
    try:
        return importlib.metadata.version("serval")
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_VERSION


def model_facts(model: str, info: RunnerInfo, max_model_len: int) -> dict[str, str | int]:
    """The served model's facts, keyed as the gauge's labels.

    max_model_len: the longest prompt + completion the engine accepts (what /v1/models reports), which a
    small KV cache can make shorter than the model's own context (info.max_model_len).
    """
    return {
        "model": model,
        "architecture": info.architecture,
        "weight_format": info.weight_format,
        "dtype": info.dtype,
        "kv_cache_dtype": info.cache_dtype,
        "device": info.device,
        "kernel_variant": info.kernel_variant,
        "attention_backend": info.attention_backend,
        "batch_activations": info.batch_activations,
        "num_threads": info.num_threads,
        "kv_cache_tokens": info.kv_cache_tokens,
        "max_model_len": max_model_len,
        "speculative_decoding": info.speculative_decoding,
    }
