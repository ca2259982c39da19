"""Where a model runs and in what dtype: the device a config names, the compute dtype `auto` picks for it, and
whether a GGUF's block-quantized matrices stay packed for the native kernels."""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, weight_formats: tuple[str, ...] = ()) -> torch.dtype:
    """auto: on CUDA the checkpoint's 16-bit type as stored (fp16 where most weights are F16, else bf16)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.float16 if weight_formats[:1] == ("F16",) else torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def keeps_packed_weights(dtype_name: str, dtype: torch.dtype, kernels, has_packable_weights: bool) -> bool:
    """Whether a GGUF's block-quantized matrices (Q4_0 ... Q6_K) run packed in the native kernels.

    Always on the bf16 path. In fp32 only when the dtype was left to `auto` (a CPU without native bf16): the
    kernels compute in fp32 from the file's exact weights at the file's size, where a dense fp32 copy would
    take 7x it (F16/BF16 matrices: 2x); an explicit `float32` asks for exact dense matmuls and gets them.
    Never on CUDA (no native kernels there): block formats are dequantized once at load into the compute
    dtype, 2 bytes a weight in bf16, 3.6x a Q4 file (docs/cuda.md, "GGUF on CUDA: the memory cost").
    """
    if kernels is None:
        return False
    return dtype == torch.bfloat16 or (dtype_name == "auto" and has_packable_weights)
