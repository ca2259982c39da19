"""`serval serve` with a model it can't use exits with one clear line, not a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

SERVAL = [sys.executable, "-m", "serval.entrypoints.cli", "serve", "--port", "1"]


def _run(model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SERVAL, "--model", model], capture_output=True, text=True, timeout=120, check=False
    )


def test_missing_model_path(tmp_path):
    result = _run(str(tmp_path / "nothing-here"))
    assert result.returncode != 0
    assert "model not found" in result.stderr and "Traceback" not in result.stderr


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 20)
    result = _run(str(path))
    assert result.returncode != 0
    assert "cannot load the model" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"architectures": ["FooForCausalLM"]}, "unknown architecture 'FooForCausalLM'"),
        ({"architectures": []}, "names no architecture"),
    ],
)
def test_unknown_architecture(tiny_model_factory, tmp_path, config, message):
    directory, _ = tiny_model_factory("llama", False)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in os.listdir(directory):
        shutil.copy(os.path.join(directory, name), model_dir / name)
    with open(model_dir / "config.json") as f:
        original = json.load(f)
    original.update(config)
    (model_dir / "config.json").write_text(json.dumps(original))
    result = _run(str(model_dir))
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
