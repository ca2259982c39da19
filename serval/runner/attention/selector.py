"""Which attention backend a runner uses: chosen once, at start-up, from the device and the kernels built.

- the CPU with the native kernels built: `NativeCpuBackend` (kernels/ read the paged cache in place);
- anything else (a CPU where nothing could be compiled, a CUDA or other torch device): `SdpaBackend`, which
  computes the same attention with PyTorch's SDPA over gathered K/V.

The place for CUDA: a backend over FlashAttention's or FlashInfer's paged kernels implements
`AttentionBackend` (backend.py: build its metadata from a `StepLayout`, run a layer's attention) and is
returned here for `device.type == "cuda"`; nothing in the model code or the runner changes. Until then CUDA
runs the SDPA backend.
"""

from __future__ import annotations

import torch

from serval.runner.attention.backend import AttentionBackend
from serval.runner.attention.native_cpu import NativeCpuBackend
from serval.runner.attention.sdpa import SdpaBackend


def select_attention_backend(device: torch.device, kernels) -> AttentionBackend:
    """kernels: the native CPU kernels module (runner/kernels), or None where none was built or loaded."""
    if device.type == "cpu" and kernels is not None:
        return NativeCpuBackend(kernels)
    return SdpaBackend()
