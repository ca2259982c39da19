"""Progress of long start-up work (loading weights): a tqdm bar on a terminal, log lines elsewhere.

A leaf module. On a terminal a bar is the clearest; in a log file (systemd, Kubernetes, a test's captured
output) a bar is either nothing or hundreds of carriage returns, so there the progress is an INFO line every
LOG_INTERVAL_S seconds, and a last one with the total time when there were any before it (work that ends
quickly says nothing).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator

from tqdm import tqdm

logger = logging.getLogger("serval.progress")

LOG_INTERVAL_S = 10.0


class LoggedProgress:
    """tqdm's face (iterate, update, close, a context manager) writing log lines instead of a bar."""

    def __init__(
        self,
        iterable: Iterable | None,
        total: int | None,
        desc: str,
        unit: str,
        interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self.iterable = iterable
        self.total = total if total is not None else _length(iterable)
        self.desc = desc
        self.unit = unit
        self.interval_s = interval_s
        self.num_done = 0
        self.num_lines = 0
        self.start = time.monotonic()
        self.next_line = self.start + interval_s

    def __iter__(self) -> Iterator:
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.num_done += n
        now = time.monotonic()
        if now >= self.next_line:
            self.next_line = now + self.interval_s
            self.num_lines += 1
            of = f"/{self.total}" if self.total else ""
            logger.info("%s: %d%s %ss, %.0f s", self.desc, self.num_done, of, self.unit, now - self.start)

    def close(self) -> None:
        if self.num_lines:
            logger.info(
                "%s: %d %ss in %.0f s", self.desc, self.num_done, self.unit, time.monotonic() - self.start
            )
            self.num_lines = 0  # once

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _length(iterable: Iterable | None) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str, unit: str = "it"):
    """A tqdm bar when stderr is a terminal, else a LoggedProgress; both iterate, update and close."""
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit)
    return LoggedProgress(iterable, total, desc, unit)
