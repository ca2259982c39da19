"""Later starts load the kernels torch built before straight from its build directory, skipping torch's JIT
builder (and the setuptools import it costs), but only when the build was made from exactly these sources
and flags; anything else goes through torch's builder as before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serval.runner import kernels
from tests.fixtures.kernels import require_kernels


def test_a_recorded_build_loads_without_torchs_builder():
    built = require_kernels()
    name = f"serval_cpu_kernels_{built.variant}"
    directory = os.path.dirname(os.path.realpath(built.__file__))
    assert os.path.realpath(kernels._expected_build_directory(name)) == directory
    with open(os.path.join(directory, kernels._BUILD_RECORD), encoding="utf-8") as f:
        assert f.read() == kernels._build_key(kernels.variant_named(built.variant))
    probe = (
        "import sys; from serval.runner.kernels import load_cpu_kernels; m = load_cpu_kernels();"
        " print(m.variant, m.__file__, 'torch.utils.cpp_extension' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "SERVAL_KERNEL_VARIANT"}
    env["SERVAL_KERNEL_VARIANT"] = built.variant
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    variant, library, imported_builder = out.stdout.split()
    assert (variant, os.path.realpath(library), imported_builder) == (
        built.variant,
        os.path.realpath(built.__file__),
        "False",
    )


def test_a_build_recorded_for_other_sources_goes_through_torchs_builder(tmp_path, monkeypatch):
    name = "serval_cpu_kernels_portable"
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"not a library")
    (tmp_path / name / kernels._BUILD_RECORD).write_text("0" * 64)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("SERVAL_DISABLE_NATIVE_KERNELS", raising=False)
    assert kernels._expected_build_directory(name) == str(tmp_path / name)
    key = kernels._build_key(kernels.variant_named("portable"))
    assert kernels._load_recorded_build(name, key) is None
    calls = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: calls.append(kwargs) or "built")
    assert kernels.load_cpu_kernels("portable") == "built"
    assert [c["name"] for c in calls] == [name]


@pytest.mark.parametrize("edit", ["source", "flags"])
def test_the_key_changes_with_the_sources_and_the_flags(edit, monkeypatch):
    variant = kernels.variant_named("portable")
    before = kernels._build_key(variant)
    if edit == "flags":
        monkeypatch.setattr(kernels, "BASE_CFLAGS", (*kernels.BASE_CFLAGS, "-DEXTRA"))
    else:
        monkeypatch.setattr(kernels, "SOURCES", kernels.SOURCES[1:])
    assert kernels._build_key(variant) != before


def test_a_recorded_build_that_does_not_import_goes_through_torchs_builder(tmp_path, monkeypatch):
    name = "serval_cpu_kernels_portable"
    key = kernels._build_key(kernels.variant_named("portable"))
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"not a library")  # a damaged build with a matching record
    (tmp_path / name / kernels._BUILD_RECORD).write_text(key)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels._load_recorded_build(name, key) is None


def test_the_default_build_directory_is_torchs_in_a_fresh_process(tmp_path):
    """Without TORCH_EXTENSIONS_DIR (CI's case, and most users') the directory comes from torch's per-user
    cache; worked out in a process that has not imported torch's builder, it must be the one the builder
    uses."""
    probe = (
        "import sys; from serval.runner.kernels import _expected_build_directory;"
        " expected = _expected_build_directory('serval_probe');"
        " assert 'torch.utils.cpp_extension' not in sys.modules;"
        " from torch.utils.cpp_extension import _get_build_directory;"
        " print(expected); print(_get_build_directory('serval_probe', verbose=False))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    expected, torchs = out.stdout.split()
    assert os.path.realpath(expected) == os.path.realpath(torchs)
    assert os.path.realpath(expected).startswith(os.path.realpath(tmp_path))


def test_a_failing_shortcut_leaves_the_build_to_torch(monkeypatch):
    def unknown_layout(name):
        raise AttributeError("a torch that keeps its builds elsewhere")

    monkeypatch.setattr(kernels, "_expected_build_directory", unknown_layout)
    monkeypatch.delenv("SERVAL_DISABLE_NATIVE_KERNELS", raising=False)
    calls = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: calls.append(kwargs) or "built")
    monkeypatch.setattr(kernels, "_remove_stale_build_lock", lambda name: None)
    monkeypatch.setattr(kernels, "_build_directory_exists", lambda name: True)
    assert kernels.load_cpu_kernels("portable") == "built"
    assert [c["name"] for c in calls] == ["serval_cpu_kernels_portable"]
