"""Kernel variants: which one a CPU gets, and that every variant compiles here, whether this CPU runs it or not.

The variants this CPU can execute are built and tested against the same references by the other kernel tests
(the `kernels` fixture); the others are compiled here from the same sources with their own target flags, so
a syntax or type error in, say, the AVX-512 path fails on an AVX2 machine too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from serval.runner.kernels import (
    SOURCES,
    VARIANTS,
    compile_flags,
    is_x86,
    load_cpu_kernels,
    runnable_variants,
    variant_named,
)
from tests.fixtures.kernels import VARIANT_NAMES, has_compiler

ZEN4 = frozenset(
    [
        "sse2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
        "avx512_bf16",
        "avx512cd",
    ]
)
ZEN3 = frozenset(["sse2", "avx", "avx2", "fma", "f16c", "bmi2"])
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # AVX-512 without VNNI and BF16
ICE_LAKE = SKYLAKE_X | {"avx512_vnni"}  # AVX-512 with VNNI, without BF16
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX2 with the 256-bit VEX form of VNNI, no AVX-512
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.skipif(not is_x86(), reason="x86 feature sets")
@pytest.mark.parametrize(
    "flags, best, also",
    [
        (ZEN4, "avx512", ["avx512_vnni", "avx2"]),
        (SAPPHIRE_RAPIDS, "avx512", ["avx512_vnni", "avx2_vnni", "avx2"]),
        (ICE_LAKE, "avx512_vnni", ["avx2"]),
        (ALDER_LAKE, "avx2_vnni", ["avx2"]),
        (ZEN3, "avx2", []),
        (SKYLAKE_X, "avx2", []),
        (frozenset({"sse2"}), "portable", None),
    ],
)
def test_the_best_variant_the_cpu_can_execute_is_chosen(flags, best, also):
    names = [v.name for v in runnable_variants(flags)]
    assert names == ([best] if also is None else [best, *also, "portable"])


def test_a_variant_the_cpu_cannot_execute_is_refused():
    missing = [v for v in VARIANTS if v not in runnable_variants()]
    if not missing:
        pytest.skip("this CPU executes every variant")
    with pytest.raises(ValueError, match="lacks"):
        load_cpu_kernels(missing[0].name)
    with pytest.raises(ValueError, match="unknown kernel variant"):
        load_cpu_kernels("avx1024")


def test_builds_are_keyed_by_explicit_target_flags():
    # A cached build made on one CPU must never run on another that lacks its instructions: no variant is
    # compiled for "whatever this machine has".
    for variant in VARIANTS:
        flags = compile_flags(variant)
        assert not any(f.startswith(("-march=native", "-mtune=native", "-mcpu=native")) for f in flags)
        assert f"-DSERVAL_VARIANT={variant.name}" in flags


def _compile_command(source: str, flags: list[str], compiler: str = "c++") -> list[str]:
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [
        f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"], os.path.dirname(source))
    ]
    # -O0: the intrinsics' target checks and every template instantiation happen at any level, faster.
    return [
        compiler, "-std=c++17", "-fPIC", "-c", "-o", os.devnull, source, "-DTORCH_EXTENSION_NAME=variant_check",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *[f for f in flags if not f.startswith("-O")], "-O0",
    ]  # fmt: skip


# The Python bindings hold no intrinsics of their own (the headers they include are the kernels' too) and
# take a quarter of a variant's compiling (torch's Python headers): the runnable variants' builds compile them.
KERNEL_SOURCES = tuple(s for s in SOURCES if os.path.basename(s) != "bindings.cpp")


def _compile_all(flags: list[str], compiler: str = "c++", sources: tuple[str, ...] = KERNEL_SOURCES) -> None:
    """Each source compiled with these flags; a failure names the file and the compiler's errors."""

    def compile_one(source: str) -> tuple[str, subprocess.CompletedProcess]:
        command = _compile_command(source, flags, compiler)
        return source, subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, sources))
    failures = [f"{os.path.basename(s)}:\n{r.stderr[-3000:]}" for s, r in results if r.returncode != 0]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_every_variant_compiles_even_where_the_cpu_cannot_run_it(name):
    if not has_compiler():
        pytest.skip("no C++ compiler on this machine")
    variant = variant_named(name)
    if variant in runnable_variants():
        pytest.skip(f"{name} runs here: built and tested in full by the kernel tests")
    if variant.compiler_flags and not is_x86():
        pytest.skip(f"{name} is an x86 variant")
    _compile_all(compile_flags(variant))


AARCH64_COMPILER = "aarch64-linux-gnu-g++"


@pytest.mark.slow
def test_the_portable_variant_compiles_for_aarch64():
    """aarch64 gets the portable variant (NEON is its baseline): its sources must at least compile there.
    With Debian's cross-compiler (.ci/run installs it), against this machine's torch headers."""
    if not is_x86():
        pytest.skip("not x86: the portable variant is built and tested natively here")
    if shutil.which(AARCH64_COMPILER) is None:
        pytest.skip(f"no {AARCH64_COMPILER} (Debian's g++-aarch64-linux-gnu) on this machine")
    _compile_all(compile_flags(variant_named("portable")), AARCH64_COMPILER, SOURCES)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    import time

    from serval.runner import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = tmp_path / "serval_cpu_kernels_test"
    directory.mkdir()
    lock = directory / "lock"
    lock.touch()
    kernels._remove_stale_build_lock("serval_cpu_kernels_test")
    assert lock.exists()  # just taken: a build is starting
    old = time.time() - 120
    os.utime(lock, (old, old))
    worker = subprocess.Popen(["sleep", "30"], cwd=directory)
    try:
        kernels._remove_stale_build_lock("serval_cpu_kernels_test")
        assert lock.exists()  # a process (ninja, the compiler) works in the build directory
    finally:
        worker.kill()
        worker.wait()
    kernels._remove_stale_build_lock("serval_cpu_kernels_test")
    assert not lock.exists()
