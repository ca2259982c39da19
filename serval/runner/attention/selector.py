"""Which attention backend a runner uses: chosen once, at start-up, from the device and the kernels built.

- the CPU with the native kernels built: `NativeCpuBackend` (kernels/ read the paged cache in place);
- CUDA: `TritonPagedBackend` (triton_paged.py: Triton kernels over the same paged cache, in place);
- anything else (a CPU where nothing could be compiled, another torch device, CUDA without triton):
  `SdpaBackend`, which computes the same attention with PyTorch's SDPA over gathered K/V.

`ModelConfig.attention_backend` may name one instead of "auto": "sdpa" anywhere, "native-cpu" on the CPU with
the kernels built, "triton" on CUDA or, under TRITON_INTERPRET=1, on the CPU (how CI runs the Triton kernels
without a GPU). A name that cannot run there is refused at start-up, not replaced.

Backends are imported lazily: triton is imported only when the Triton backend is chosen.
"""

from __future__ import annotations

import os

import torch

from serval.runner.attention.backend import AttentionBackend
from serval.runner.attention.native_cpu import NativeCpuBackend
from serval.runner.attention.sdpa import SdpaBackend

BACKEND_NAMES = ("auto", "native-cpu", "sdpa", "triton")


def select_attention_backend(device: torch.device, kernels, name: str = "auto") -> AttentionBackend:
    """kernels: the native CPU kernels module (runner/kernels), or None where none was built or loaded.
    name: ModelConfig.attention_backend."""
    if name == "sdpa":
        return SdpaBackend()
    if name == "native-cpu":
        if device.type != "cpu" or kernels is None:
            raise ValueError("attention_backend='native-cpu' needs the CPU and its native kernels built")
        return NativeCpuBackend(kernels)
    if name == "triton":
        if device.type != "cuda" and not is_triton_interpreted():
            raise ValueError("attention_backend='triton' needs CUDA, or TRITON_INTERPRET=1 on the CPU")
        return _triton_backend(required=True)
    if name != "auto":
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    if device.type == "cpu" and kernels is not None:
        return NativeCpuBackend(kernels)
    if device.type == "cuda":
        return _triton_backend(required=False) or SdpaBackend()
    return SdpaBackend()


def is_triton_interpreted() -> bool:
    """Triton kernels run on CPU tensors only through its interpreter, chosen when they are decorated."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_backend(required: bool) -> AttentionBackend | None:
    try:
        from serval.runner.attention.triton_paged import TritonPagedBackend
    except ImportError:
        if required:
            raise
        return None  # CUDA without triton: SDPA computes the same attention, slower
    return TritonPagedBackend()
