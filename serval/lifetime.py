"""Process-wide memory settings for a long-running engine: long-lived objects and the garbage collector
(freezing them after start-up, undoing that at exit), and the C heap's handling of freed memory.

A leaf module (the CLI and the offline LLM both use it). Frozen objects (gc.freeze) are never collected,
not even while the interpreter shuts down, so every extension module that counts its objects at exit
reports them as leaked: nanobind's "leaked 64 types ... 514 functions" lines come from triton, which
transformers and torch._dynamo import (xgrammar lists it but never imports it on the CPU). Unfreezing at
exit lets the shutdown collect them as it would have.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import platform

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (4 * 1024 * 1024 * sizeof(long)): allocations up to it
# come from the heap. A step's largest temporaries are below it: the default model's 64-row logits (12.6 MB
# in fp32), a 512-token chunk's MLP activations.
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30


def freeze_long_lived_objects() -> None:
    """Move every object alive now out of the collector's passes (the model, tokenizer and grammar tables are
    hundreds of thousands of them: full passes would otherwise walk them in the middle of engine steps), and
    hand them back to it at exit."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once however many times this runs
    atexit.register(gc.unfreeze)


def keep_freed_memory() -> None:
    """Have glibc's allocator keep the memory a step frees for the next step, instead of returning it to the
    kernel and faulting it back in, zeroed, page by page. By default a tensor of more than 128 KB (later:
    the largest freed so far, up to 32 MB) is its own mmap, unmapped when freed, and a heap's free top is
    trimmed past 128 KB: each step then re-faults its logits and activations. A 64-sequence decode of the
    default model (137-token prompts, 128 tokens out, offline) took 457,000 page faults with the defaults
    and 189,000 with this (the rest: loading), ~3% of its time in the kernel's page zeroing. The
    heap keeps at most what a step's peak needs. No-op off glibc."""
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
