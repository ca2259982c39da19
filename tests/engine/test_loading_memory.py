"""serval.engine.loading.keep_freed_memory: freed step-sized buffers are reused, not faulted back in page by page."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

# 31 allocate-write-free rounds of a 12.6 MB tensor (the default model's 64-row fp32 logits); prints the minor
# page faults of each of the last 30 rounds. "fixed" pins glibc's threshold at its documented start (128 KB): each
# such tensor is then its own mapping. (glibc's own default raises the threshold after the first free, and
# whether the heap's top is trimmed then depends on what else the heap holds: 4,700-24,600 faults here.)
ROUNDS = """
import ctypes, json, resource, sys, torch
if sys.argv[1] == "keep":
    from serval.engine.loading import keep_freed_memory
    keep_freed_memory()
else:
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
def round_trip():
    logits = torch.empty(64, 49152)
    logits.fill_(1.0)
    del logits
round_trip()
faults = []
for _ in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_trip()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def page_faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_freed_buffers_are_reused_without_page_faults():
    # Medians over the rounds: a round's count also takes the process's other first touches and the host's
    # memory reclaim, seen as a few thousand faults in the odd round either way.
    assert statistics.median(page_faults("fixed")) > 0  # each round's new mapping is faulted in
    assert statistics.median(page_faults("keep")) == 0  # kept: the same pages serve every round
