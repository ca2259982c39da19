"""Run serval and a peer server alternately in one sitting with bench/serve.py, and print the ratios.

Each round starts one server, waits for /health, runs the load levels, stops it (by process id), then does
the same for the other; rounds alternate so that drift on a shared machine hits both. Prints every
bench/serve.py JSON line, then one ratio line per concurrency level (medians over rounds).

    .venv/bin/python bench/compare.py --rounds 2 --concurrency 1,16 \
        --peer-label llama-server \
        --peer-command "/tmp/peer-llamacpp/bin/llama-cpp-server -m MODEL.gguf --host 127.0.0.1 --port {port} -np 64 -c 16384"

bench/peers.md says how to install each peer.

Against another build of serval (an A/B), give each side its own tree and kernel cache, and start compare.py
from a directory that is neither tree: `python -m serval.cli` puts the working directory ahead of PYTHONPATH
on sys.path, so from inside one tree both servers import that tree (a sitting on 2026-12-07 measured a build
against itself that way).

    cd /tmp && /work/new/.venv/bin/python /work/new/bench/compare.py --peer-label base \
        --serval-command "env PYTHONPATH=/work/new TORCH_EXTENSIONS_DIR=/tmp/ext-new python -m serval.cli serve --port {port}" \
        --peer-command "env PYTHONPATH=/work/base TORCH_EXTENSIONS_DIR=/tmp/ext-base python -m serval.cli serve --port {port}"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: str, port: int, log_path: str) -> tuple[subprocess.Popen, float]:
    """The started server and the seconds it took to answer /health (loading the model included)."""
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            shlex.split(command.replace("{port}", str(port))), stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command!r} exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"{command!r} did not become healthy; see {log_path}")


def peak_rss_mib(process: subprocess.Popen) -> float | None:
    """The server's peak resident memory so far (VmHWM), read before it is stopped."""
    try:
        with open(f"/proc/{process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def run_levels(label: str, port: int, args) -> list[dict]:
    command = [
        sys.executable, os.path.join(HERE, "serve.py"), "--url", f"http://127.0.0.1:{port}",
        "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--label", label,
        "--prompt-tokens", str(args.prompt_tokens),
        *(["--num-requests", str(args.num_requests)] if args.num_requests else []),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--serval-command",
        default=f"{sys.executable} -m serval.cli serve --port {{port}} --log-level warning",
    )
    parser.add_argument("--peer-command", required=True, help="with {port} where the port goes")
    parser.add_argument("--peer-label", default="peer")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=100, help="words of prompt (bench/serve.py)")
    parser.add_argument("--num-requests", type=int, default=0, help="per level (default: bench/serve.py's)")
    parser.add_argument(
        "--log-dir", default="/tmp", help="where bench-LABEL.log goes (one of its own beside other sittings)"
    )
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"serval": [], args.peer_label: []}
    servers = [("serval", args.serval_command), (args.peer_label, args.peer_command)]
    for round_index in range(args.rounds):
        order = servers if round_index % 2 == 0 else servers[::-1]
        for label, command in order:
            port = free_port()
            process, ready_s = start(command, port, os.path.join(args.log_dir, f"bench-{label}.log"))
            try:
                results[label] += run_levels(label, port, args)
                print(json.dumps({
                    "server": label, "round": round_index, "ready_s": round(ready_s, 1),
                    "peak_rss_mib": peak_rss_mib(process),
                }), flush=True)  # fmt: skip
            finally:
                stop(process)
    for concurrency in (int(c) for c in args.concurrency.split(",")):

        def median(label: str, key: str, sub: str | None = None, c: int = concurrency) -> float:
            values = [r[key][sub] if sub else r[key] for r in results[label] if r["concurrency"] == c]
            return statistics.median(values)

        ours, theirs = median("serval", "output_tokens_per_s"), median(args.peer_label, "output_tokens_per_s")
        ttft_ours = median("serval", "ttft_ms", "p50")
        ttft_theirs = median(args.peer_label, "ttft_ms", "p50")
        itl_ours, itl_theirs = median("serval", "itl_ms", "p50"), median(args.peer_label, "itl_ms", "p50")
        print(json.dumps({
            "compare": f"serval vs {args.peer_label}", "concurrency": concurrency, "rounds": args.rounds,
            "serval_tok_s": ours, "peer_tok_s": theirs, "throughput_ratio": round(ours / theirs, 2),
            "serval_ttft_p50_ms": ttft_ours, "peer_ttft_p50_ms": ttft_theirs,
            "ttft_ratio": round(ttft_ours / ttft_theirs, 2),
            "serval_itl_p50_ms": itl_ours, "peer_itl_p50_ms": itl_theirs,
            "per_stream_decode_ratio": round(itl_theirs / itl_ours, 2),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
