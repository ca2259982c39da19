"""Draw serval against llama-server from the side-by-side runs in bench/results/, as docs/benchmarks.md shows.

Reads the ratio lines that bench/compare.py prints last (`{"compare": "serval vs llama-server", "concurrency":
C, "throughput_ratio": ..., "per_stream_decode_ratio": ..., ...}`) from the result files that SOURCES names:
for each model and CPU the latest sitting, the same one docs/benchmarks.md quotes. Where a file holds several
sittings (2026-12-01's), its last line per concurrency is the latest. The bench/serve.py lines and the
`{"server": ...}` lines beside them are not read. Draws one PNG of two panels, grouped bars by model (one bar
per CPU, the value written on it, a line at 1.0):

- one stream (C=1): decode speed per stream, llama-server's inter-token p50 over serval's (above 1: serval
  is faster), since the C=1 throughput is skewed where llama-server dropped requests;
- 16 and 64 streams: output tokens/s, serval's over llama-server's.

    pip install -e '.[bench]'    # matplotlib
    .venv/bin/python bench/plot_results.py --out docs/benchmarks/serval-vs-llama-server.png

Deterministic: the same files give the same PNG bytes on the same matplotlib (no timestamp, no version in
its metadata). A file SOURCES names but bench/results/ lacks is an error, not a gap in the chart.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = "serval vs llama-server"

# (key, legend label, colour); the legend's order. Each label names the CPU as its dated section records it.
CPUS = [
    ("zen2", "AMD EPYC 7002 (Zen 2), AVX2 only, 2026-12-02", "#8c564b"),
    ("zen3", "AMD EPYC fam. 25 model 1, AVX2 only, 2026-12-04/07", "#bcbd22"),
    ("epyc-12-01", "AMD EPYC, AVX-512 + BF16 + VNNI, 2026-12-01", "#7f7f7f"),
    ("zen4", "AMD EPYC (Zen 4), AVX-512 + BF16 + VNNI, 2026-12-03/04", "#1f77b4"),
    ("fam26", "AMD EPYC fam. 26 (Zen 5-class), AVX-512, 2026-12-06", "#2ca02c"),
    ("xeon", "Intel Xeon, AVX-512 + AVX-VNNI + AMX, 2026-12-04", "#d62728"),
    ("xeon-avx2", "the same Xeon, both held to AVX2, 2026-12-04", "#ff9896"),
]

# (model label, CPU key, result file): the latest sitting of each pair, as the front page's tables quote it.
SOURCES = [
    ("135M Q4_1\n(default)", "zen2", "2026-12-02-avx2-after-fix-serval-vs-llama-server.jsonl"),
    ("135M Q4_1\n(default)", "epyc-12-01", "2026-12-01-evening-serval-vs-llama-server.jsonl"),
    ("135M Q4_1\n(default)", "zen4", "2026-12-03-avx512-smollm2-135m-Q4_1-serval-vs-llama-server.jsonl"),
    ("135M Q4_1\n(default)", "zen4", "2026-12-04a-avx512-smollm2-135m-Q4_1-serval-vs-llama-server.jsonl"),
    (
        "135M Q4_1\n(default)",
        "xeon",
        "2026-12-04c-xeon-avx512-smollm2-135m-Q4_1-serval-vs-llama-server.jsonl",
    ),
    (
        "135M Q4_1\n(default)",
        "xeon-avx2",
        "2026-12-04c-xeon-avx2-held-smollm2-135m-Q4_1-serval-vs-llama-server.jsonl",
    ),
    ("135M Q4_1\n(default)", "fam26", "2026-12-06j-zen5-serval-vs-llama-server.jsonl"),
    ("135M Q4_1\n(default)", "zen3", "2026-12-07f-zen3-smollm2-135m-Q4_1-serval-vs-llama-server.jsonl"),
    ("1B Q4_0", "zen2", "2026-12-02-avx2-llama-3.2-1b-Q4_0-round2-serval-vs-llama-server.jsonl"),
    ("1B Q4_0", "zen4", "2026-12-04b-avx512-llama-3.2-1b-Q4_0-serval-vs-llama-server.jsonl"),
    ("1B Q4_0", "xeon", "2026-12-04c-xeon-avx512-llama-3.2-1b-Q4_0-serval-vs-llama-server.jsonl"),
    ("1B Q4_0", "zen3", "2026-12-07f-zen3-llama-3.2-1b-Q4_0-serval-vs-llama-server.jsonl"),
    ("1B Q4_K_M", "zen2", "2026-12-02-avx2-llama-3.2-1b-Q4_K_M-session3-serval-vs-llama-server.jsonl"),
    ("1B Q4_K_M", "zen4", "2026-12-04b-avx512-llama-3.2-1b-Q4_K_M-serval-vs-llama-server.jsonl"),
    # Not 2026-12-07h's zen3 Q4_K_M sitting: llama-server dropped requests at C=16 there, so its tok/s ratio
    # is not quoted (docs/benchmarks.md).
    ("1B Q5_K_M", "zen3", "2026-12-07i-zen3-llama-3.2-1b-Q5_K_M-serval-vs-llama-server.jsonl"),
    ("3B Q4_0", "zen2", "2026-12-02-avx2-llama-3.2-3b-Q4_0-serval-vs-llama-server.jsonl"),
    ("7B Q4_0", "zen2", "2026-12-02-avx2-llama-2-7b-Q4_0-serval-vs-llama-server.jsonl"),
    ("7B Q4_0", "zen4", "2026-12-04a-avx512-llama-2-7b-Q4_0-c1-serval-vs-llama-server.jsonl"),
    ("7B Q4_0", "zen4", "2026-12-04a-avx512-llama-2-7b-Q4_0-c16-serval-vs-llama-server.jsonl"),
    ("Qwen3-30B-A3B\nQ4_0 (MoE)", "zen3", "2026-12-04d-epyc-avx2-qwen3-30b-a3b-compare.jsonl"),
    ("Qwen3-30B-A3B\nQ4_0 (MoE)", "fam26", "2026-12-06a-zen5-qwen3-30b-a3b-compare.jsonl"),
    ("Qwen3-30B-A3B\nQ4_K_M (MoE)", "fam26", "2026-12-06a-zen5-qwen3-30b-a3b-Q4_K_M-compare.jsonl"),
    ("gpt-oss-20b\nMXFP4 (MoE)", "zen3", "2026-12-04e-epyc-avx2-gpt-oss-20b-compare.jsonl"),
    ("gpt-oss-20b\nMXFP4 (MoE)", "fam26", "2026-12-06a-zen5-gpt-oss-20b-compare.jsonl"),
]


@dataclass(frozen=True)
class Ratio:
    """One bar: a ratio as bench/compare.py wrote it, and where it came from."""

    model: str  # SOURCES' model label
    cpu: str  # a CPUS key
    concurrency: int  # requests in flight
    metric: str  # "per_stream_decode_ratio" or "throughput_ratio"
    value: float  # the line's own (rounded) figure
    file: str  # the result file's name


def last_compare_lines(path: str) -> dict[int, dict]:
    """The last llama-server ratio line per concurrency in one result file (later sittings are appended)."""
    found: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("compare") == PEER:
                found[record["concurrency"]] = record
    return found


def collect(results_dir: str) -> list[Ratio]:
    """Every bar: per stream at C=1, throughput at C=16 and C=64, from the files SOURCES names."""
    ratios: dict[tuple[str, str, int, str], Ratio] = {}
    for model, cpu, name in SOURCES:
        path = os.path.join(results_dir, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: named in SOURCES of bench/plot_results.py")
        for concurrency, record in sorted(last_compare_lines(path).items()):
            if concurrency not in (1, 16, 64):
                continue
            metric = "per_stream_decode_ratio" if concurrency == 1 else "throughput_ratio"
            key = (model, cpu, concurrency, metric)
            # NOTE: a later file in SOURCES replaces an earlier one for the same bar (the latest goes last).
            ratios[key] = Ratio(model, cpu, concurrency, metric, float(record[metric]), name)
    return list(ratios.values())


def groups_of(ratios: list[Ratio], concurrencies: tuple[int, ...]) -> list[tuple[str, dict[str, float]]]:
    """(group label, {cpu: value}) in SOURCES' model order, one group per model and concurrency measured."""
    models = list(dict.fromkeys(model for model, _, _ in SOURCES))
    groups = []
    for model in models:
        for concurrency in concurrencies:
            bars = {r.cpu: r.value for r in ratios if r.model == model and r.concurrency == concurrency}
            if bars:
                label = model if len(concurrencies) == 1 else f"{model}\nC={concurrency}"
                groups.append((label, bars))
    return groups


def draw_panel(ax, groups: list[tuple[str, dict[str, float]]], title: str, ylabel: str) -> None:
    """Grouped bars, each group's bars side by side in CPUS' order, each value written above its bar."""
    width = 0.8 / max(len(bars) for _, bars in groups)
    colours = {key: colour for key, _, colour in CPUS}
    for index, (_, bars) in enumerate(groups):
        present = [key for key, _, _ in CPUS if key in bars]
        left = index - width * len(present) / 2
        for slot, cpu in enumerate(present):
            x = left + width * (slot + 0.5)
            ax.bar(x, bars[cpu], width * 0.95, color=colours[cpu])
            ax.text(
                x, bars[cpu] + 0.03, f"{bars[cpu]:.2f}", ha="center", va="bottom", fontsize=6.5, rotation=90
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=7.5)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    top = max(value for _, bars in groups for value in bars.values())
    ax.set_ylim(0, top * 1.18)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9.5, loc="left")
    ax.tick_params(axis="y", labelsize=7.5)
    ax.grid(axis="y", linewidth=0.3, alpha=0.6)
    ax.set_axisbelow(True)


def draw(ratios: list[Ratio], out_path: str) -> None:
    """Both panels and one legend of the CPUs drawn, written as a PNG without a timestamp or version."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.5), dpi=110)
    draw_panel(
        top, groups_of(ratios, (1,)),
        "One stream (C=1): decode speed per stream, llama-server's inter-token p50 / serval's",
        "x llama-server (above 1: serval faster)",
    )  # fmt: skip
    draw_panel(
        bottom, groups_of(ratios, (16, 64)),
        "16 and 64 streams: output tokens/s, serval / llama-server",
        "x llama-server (above 1: serval faster)",
    )  # fmt: skip
    drawn = {r.cpu for r in ratios}
    handles = [Patch(color=colour, label=label) for key, label, colour in CPUS if key in drawn]
    figure.legend(handles=handles, loc="lower center", ncol=2, fontsize=7.5, frameon=False)
    figure.suptitle(
        "serval against llama-server (llama.cpp) on 2 CPU cores, same GGUF file; bench/results/*.jsonl",
        fontsize=10.5,
    )
    figure.tight_layout(rect=(0, 0.09, 1, 0.97))
    # NOTE: no "Software" key and no date, so that reruns over the same files give the same bytes.
    figure.savefig(out_path, metadata={"Software": None})
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    parser.add_argument(
        "--out", default=os.path.join(HERE, os.pardir, "docs", "benchmarks", "serval-vs-llama-server.png")
    )
    parser.add_argument("--list", action="store_true", help="print every bar's value and file, draw nothing")
    args = parser.parse_args()
    ratios = collect(args.results_dir)
    if args.list:
        for r in ratios:
            model = r.model.replace("\n", " ")
            print(f"{model:28} {r.cpu:11} C={r.concurrency:<3} {r.metric:24} {r.value:5.2f}  {r.file}")
        return
    draw(ratios, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
