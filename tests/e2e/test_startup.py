"""Start-up that talks and an exit that doesn't: one summary line naming what runs, how and where, and no
third-party noise on stderr after shutdown, for a server and for the offline LLM.

Both processes import triton first (as one that has imported transformers' models or torch._dynamo does):
with the long-lived objects frozen and never collected, triton's nanobind bindings would print ~30 "leaked"
lines at exit; serval.lifetime unfreezes them at exit so shutdown collects them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.e2e.conftest import running_server

# A real server process with the default model.
pytestmark = pytest.mark.slow

PRELUDE = "import transformers.modeling_utils, sys; assert 'triton' in sys.modules; "


def test_server_summary_line_and_a_quiet_exit(tmp_path):
    program = [sys.executable, "-c", PRELUDE + "from serval.entrypoints.cli import main; main(sys.argv[1:])"]
    args = ["--max-num-seqs", "7", "--dtype", "float32", "--log-level", "warning"]
    stderr_path = tmp_path / "stderr.log"
    with running_server(args, stderr_path, program=program, stdout_to_log=False) as server:
        version = httpx.get(server.base_url + "/version", timeout=10).json()
        with open(f"/proc/{server.process.pid}/maps") as maps:
            assert "libtriton" in maps.read()  # the condition the quiet exit is tested under
        os.kill(server.process.pid, signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    stderr = stderr_path.read_text()
    assert "nanobind" not in stderr and "leaked" not in stderr, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if " INFO serval: model " in line]
    expected = (
        f"model {version['model']}: {version['architecture']}, weights {version['weight_format']}"
        f"{' (packed)' if '(packed)' in line else ''}, compute dtype {version['dtype']} on {version['device']},"
        f" CPU kernels {version['kernel_variant']}, {version['num_threads']} threads,"
        f" KV cache {version['kv_cache_tokens']} tokens ("
    )
    assert expected in line
    assert line.endswith(f", up to 7 sequences at once, serving on {server.base_url}")
    # Not a terminal: no progress bar's carriage returns in the log.
    assert "\r" not in stderr


def test_offline_llm_exits_quietly(tmp_path):
    script = PRELUDE + textwrap.dedent(
        """
        from serval import LLM, SamplingParams
        [out] = LLM().generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))
        print(repr(out.outputs[0].text))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.fullmatch(r"'.+'\n", result.stdout)
    assert "nanobind" not in result.stderr and "leaked" not in result.stderr, result.stderr[-3000:]
