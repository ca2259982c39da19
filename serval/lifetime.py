"""Long-lived objects and the garbage collector: freezing them after start-up, and undoing that at exit.

A leaf module (the CLI and the offline LLM both use it). Frozen objects (gc.freeze) are never collected,
not even while the interpreter shuts down, so every extension module that counts its objects at exit
reports them as leaked: nanobind's "leaked 64 types ... 514 functions" lines come from triton, which
transformers and torch._dynamo import (xgrammar lists it but never imports it on the CPU). Unfreezing at
exit lets the shutdown collect them as it would have.
"""

from __future__ import annotations

import atexit
import gc


def freeze_long_lived_objects() -> None:
    """Move every object alive now out of the collector's passes (the model, tokenizer and grammar tables are
    hundreds of thousands of them: full passes would otherwise walk them in the middle of engine steps), and
    hand them back to it at exit."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once however many times this runs
    atexit.register(gc.unfreeze)
