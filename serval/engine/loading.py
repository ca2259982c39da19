"""Building the Engine: off the caller's thread, with the loader's freed memory handed back to the OS after,
and the C heap then set to keep what the engine's steps free.

Owns where the weights load (a helper thread: see build_engine's NOTE) and glibc's handling of freed memory
(malloc_trim after loading, mallopt for the steps); the server (EngineClient.start, in each Ray replica too)
and the offline LLM build their engine here.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading

from serval.config import EngineConfig
from serval.engine.engine import Engine

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (4 * 1024 * 1024 * sizeof(long)): allocations up to it
# come from the heap. A step's largest temporaries are below it: the default model's 64-row logits (12.6 MB
# in fp32), a 512-token chunk's MLP activations.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30


def build_engine(config: EngineConfig) -> Engine:
    """The Engine of `config`, built on a helper thread: the caller's thread never runs an OpenMP region."""
    # NOTE: not on the caller's thread (the main one). Once the main thread has run an OpenMP parallel region
    # (loading the weights runs many), every region another thread starts costs ~50 us more (libgomp;
    # measured: an elementwise op 27 -> 75 us, a 137-token prefill 64 -> 100+ ms on the engine thread).
    built: dict[str, object] = {}

    def build() -> None:
        try:
            built["engine"] = Engine(config)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
            built["error"] = e
        _release_freed_memory()

    builder = threading.Thread(target=build, name="serval-engine-load")
    builder.start()
    builder.join()
    if "error" in built:
        raise built["error"]
    keep_freed_memory()  # after the loader's trim: from here on, what a step frees stays for the next
    return built["engine"]


def _release_freed_memory() -> None:
    """Hand the loader's freed fp32 buffers back to the OS (glibc keeps them in the loading thread's malloc
    arena: ~300 MB of resident memory for the default model otherwise). A no-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_freed_memory() -> None:
    """Have glibc's allocator keep the memory a step frees for the next step, instead of returning it to the
    kernel and faulting it back in, zeroed, page by page. By default a tensor of more than 128 KB (later:
    the largest freed so far, up to 32 MB) is its own mmap, unmapped when freed, and a heap's free top is
    trimmed past 128 KB: each step then re-faults its logits and activations. A 64-sequence decode of the
    default model (137-token prompts, 128 tokens out, offline) took 457,000 page faults with the defaults
    and 189,000 with this (the rest: loading), ~3% of its time in the kernel's page zeroing. The
    heap keeps at most what a step's peak needs. Process-wide, set once per built engine; no-op off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(None)
        accepted = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) and libc.mallopt(
            _M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES
        )
    except (OSError, AttributeError) as e:  # a C library without mallopt: its own defaults stand
        logger.debug("mallopt unavailable (%s); the allocator keeps its defaults", e)
        return
    if not accepted:
        logger.debug("glibc refused the mallopt thresholds; the allocator keeps its defaults")
