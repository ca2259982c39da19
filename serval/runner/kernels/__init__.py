"""Native CPU kernels, compiled on first use with the machine's C++ compiler and cached.

`load_cpu_kernels()` returns the compiled module, or None when it can't be built (no compiler, no ninja):
callers then take the plain-PyTorch path, which computes the same thing more slowly.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernels.cpp")


def load_cpu_kernels():
    if os.environ.get("SERVAL_DISABLE_NATIVE_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # NOTE: torch caches the build by source hash under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions),
        # so only the first start on a machine pays the ~1 min compile.
        return load(
            name="serval_cpu_kernels",
            sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch attention path", e)
        return None
