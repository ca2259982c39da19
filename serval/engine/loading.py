"""Building the Engine: off the caller's thread, and with the loader's freed memory handed back to the OS after.

Owns where the weights load (a helper thread: see build_engine's NOTE) and the malloc_trim after; the server
(EngineClient.start) and the offline LLM build their engine here.
"""

from __future__ import annotations

import ctypes
import threading

from serval.config import EngineConfig
from serval.engine.engine import Engine


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
    return built["engine"]


def _release_freed_memory() -> None:
    """Hand the loader's freed fp32 buffers back to the OS (glibc keeps them in the loading thread's malloc
    arena: ~300 MB of resident memory for the default model otherwise). A no-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
