"""serval.lifetime.keep_freed_memory: freed step-sized buffers are reused, not faulted back in page by page."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

# 31 allocate-write-free rounds of a 12.6 MB tensor (the default model's 64-row fp32 logits); prints the minor
# page faults of the last 30 rounds. "fixed" pins glibc's threshold at its documented start (128 KB): each
# such tensor is then its own mapping. (glibc's own default raises the threshold after the first free, and
# whether the heap's top is trimmed then depends on what else the heap holds: 4,700-24,600 faults here.)
ROUNDS = """
import ctypes, json, resource, sys, torch
if sys.argv[1] == "keep":
    from serval.lifetime import keep_freed_memory
    keep_freed_memory()
else:
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
def round_trip():
    logits = torch.empty(64, 49152)
    logits.fill_(1.0)
    del logits
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    round_trip()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_freed_buffers_are_reused_without_page_faults():
    pages_per_round = 64 * 49152 * 4 // 4096
    assert page_faults("fixed") >= 30 * pages_per_round  # every round faults its pages in again
    # Kept, they do not. (Seen: 0-5,200 faults in all, the process's other first-time touches and the
    # host's memory reclaim; a third of the unkept count leaves room for those.)
    assert page_faults("keep") < 10 * pages_per_round
