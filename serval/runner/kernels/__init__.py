"""Native CPU kernels, compiled on first use with the machine's C++ compiler and cached.

`load_cpu_kernels()` returns the compiled module, or None when it can't be built (no compiler, no ninja):
callers then take the plain-PyTorch path, which computes the same thing more slowly.
"""

from __future__ import annotations

import hashlib
import logging
import os

logger = logging.getLogger(__name__)

_DIRECTORY = os.path.dirname(__file__)
_SOURCES = [
    os.path.join(_DIRECTORY, name)
    for name in (
        "cpu_kernels.cpp",
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "decode_stack.cpp",
        "quantized_linear.cpp",
    )
]
_HEADER = os.path.join(_DIRECTORY, "common.h")


def _header_digest() -> str:
    # torch hashes the sources and the flags to decide whether its cached build is current, not the headers
    # they include: the header's digest goes into the flags so an edit to it rebuilds.
    with open(_HEADER, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def load_cpu_kernels():
    if os.environ.get("SERVAL_DISABLE_NATIVE_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # NOTE: torch caches the build by source hash under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions),
        # so only the first start on a machine pays the ~1 min compile.
        return load(
            name="serval_cpu_kernels",
            sources=_SOURCES,
            extra_include_paths=[_DIRECTORY],
            extra_cflags=[
                "-O3",
                "-march=native",
                "-ffast-math",
                "-fopenmp",
                f"-DSERVAL_HEADER={_header_digest()}",
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch attention path", e)
        return None
