"""What start-up says before the model is ready: the line before the first kernel compile, and the progress
of loading weights (a bar on a terminal, log lines elsewhere)."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from serval.progress import LoggedProgress, progress
from serval.runner import kernels


def test_the_first_compile_is_announced_with_the_cpu_features(monkeypatch, caplog):
    built = object()
    monkeypatch.delenv("SERVAL_DISABLE_NATIVE_KERNELS", raising=False)
    monkeypatch.delenv("SERVAL_KERNEL_VARIANT", raising=False)
    monkeypatch.setattr(kernels, "_build_directory_exists", lambda name: False)
    monkeypatch.setattr(kernels, "_remove_stale_build_lock", lambda name: None)
    monkeypatch.setattr(kernels, "_load_recorded_build", lambda name, key: None)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: built)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.load_cpu_kernels("portable") is built
    [announce, done] = [r.getMessage() for r in caplog.records]
    assert announce.startswith(
        f"compiling native kernels for baseline {os.uname().machine} (portable variant)"
    )
    assert "first start only, usually about two minutes" in announce
    assert done.startswith("native CPU kernels compiled in")
    best = kernels.runnable_variants()[0]
    if best.cpu_flags:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=kernels.__name__):
            kernels.load_cpu_kernels(best.name)
        assert f"compiling native kernels for {' '.join(best.cpu_flags)} ({best.name} variant)" in (
            caplog.records[0].getMessage()
        )


def test_logged_progress_says_how_far_and_how_long(caplog):
    with caplog.at_level(logging.INFO, logger="serval.progress"):
        items = list(LoggedProgress(["a", "b", "c"], None, "loading weights", "tensor", interval_s=0.0))
    assert items == ["a", "b", "c"]
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines[:3]] == [
        f"loading weights: {i}/3 tensors" for i in (1, 2, 3)
    ]
    assert lines[3].startswith("loading weights: 3 tensors in ") and len(lines) == 4


def test_quick_work_says_nothing(caplog):
    with (
        caplog.at_level(logging.INFO, logger="serval.progress"),
        LoggedProgress(None, 5, "weights", "tensor") as bar,
    ):
        for _ in range(5):
            bar.update(1)
    assert caplog.records == []


def test_a_bar_on_a_terminal_and_log_lines_elsewhere(monkeypatch):
    with open(os.devnull, "w") as log_file:
        monkeypatch.setattr(sys, "stderr", log_file)
        assert isinstance(progress([1], desc="x"), LoggedProgress)
    primary, secondary = os.openpty()
    terminal = os.fdopen(secondary, "w")
    monkeypatch.setattr(sys, "stderr", terminal)
    try:
        bar = progress([1], desc="x")
        assert isinstance(bar, tqdm) and not bar.disable
        bar.close()
    finally:
        terminal.close()
        os.close(primary)
