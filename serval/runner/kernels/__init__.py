"""Native CPU kernels: one build per instruction-set variant, the best one this CPU runs chosen at load.

The same sources are compiled with each variant's explicit target flags (never `-march=native`), into a
module named after the variant, so a build cache or image made on one CPU can never hand another CPU
instructions it lacks:

- `avx512`: AVX-512 F/BW/VL/DQ with VNNI and BF16 (Zen 4, Sapphire Rapids and later);
- `avx512_vnni`: the same without BF16 (Cascade Lake, Ice Lake, Tiger Lake): bf16 weights are widened to fp32
  in registers instead of multiplied as bf16 pairs;
- `avx2_vnni`: AVX2, FMA and F16C with AVX-VNNI, VPDPBUSD/VPDPWSSD on 256-bit registers (Alder Lake and later
  client chips, Sierra Forest);
- `avx2`: AVX2, FMA and F16C (Haswell and Zen 1 on; also Skylake-X's AVX-512 without VNNI);
- `portable`: the compiler's baseline for the target (SSE2 on x86-64, NEON on aarch64).

`load_cpu_kernels()` returns the compiled module of the best variant (its `variant` attribute names it), or
None when nothing can be built (no compiler, no ninja): callers then take the plain-PyTorch path, which
computes the same thing more slowly.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_DIRECTORY = os.path.dirname(__file__)
SOURCES = tuple(
    os.path.join(_DIRECTORY, name)
    for name in (
        "bindings.cpp",
        "cpu_kernels.cpp",
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "decode_stack.cpp",
        "quantized_linear.cpp",
        "packed_linear.cpp",
        "quantized_int8.cpp",
        "dense_linear.cpp",
        "gguf_repack.cpp",
        "moe.cpp",
    )
)
_HEADERS = tuple(
    os.path.join(_DIRECTORY, name)
    for name in (
        "common.h",
        "simd.h",
        "quantized.h",
        "int8_split.h",
        "group_output.h",
        "int8_codes.h",
        "int8_rows_amx.h",
        "int8_rows_avx2.h",
        "decode_stack.h",
    )
)
# -fno-associative-math: fast math without reordering sums, so a loop adds in the order it is written in every
# place it is inlined (the explicit SIMD code fixes its own order; the plain loops' order would otherwise be
# the vectorizer's choice per call site, and a row's bits would depend on which kernel computed it: batch
# invariance, docs/architecture.md).
BASE_CFLAGS = ("-O3", "-ffast-math", "-fno-associative-math", "-fopenmp")


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo spells them; all needed to run the build
    compiler_flags: tuple[str, ...]


_AVX2 = (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"))
_AVX512_VNNI = (
    (*_AVX2[0], "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    (*_AVX2[1], "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
)
VARIANTS = (  # best first
    Variant("avx512", (*_AVX512_VNNI[0], "avx512_bf16"), (*_AVX512_VNNI[1], "-mavx512bf16")),
    Variant("avx512_vnni", *_AVX512_VNNI),
    Variant("avx2_vnni", (*_AVX2[0], "avx_vnni"), (*_AVX2[1], "-mavxvnni")),
    Variant("avx2", *_AVX2),
    Variant("portable", (), ()),
)
_X86_ONLY = frozenset(v.name for v in VARIANTS if v.compiler_flags)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runnable_variants(flags: frozenset[str] | None = None) -> list[Variant]:
    """The variants this CPU can execute, best first (`portable` always)."""
    flags = cpu_flags() if flags is None else flags
    return [
        v
        for v in VARIANTS
        if (v.name not in _X86_ONLY or is_x86()) and all(flag in flags for flag in v.cpu_flags)
    ]


def variant_named(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"unknown kernel variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def _sources_digest() -> str:
    # torch hashes the sources and the flags to decide whether its cached build is current, not the headers
    # they include: the headers' digest goes into the flags so an edit to one rebuilds.
    digest = hashlib.sha256()
    for path in _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def compile_flags(variant: Variant) -> list[str]:
    return [
        *BASE_CFLAGS,
        *variant.compiler_flags,
        f"-DSERVAL_VARIANT={variant.name}",
        f"-DSERVAL_HEADERS={_sources_digest()}",
    ]


UNBOUNDED_ROWS = 2**62


def packed_rows_limit(kernels) -> int:
    """Up to how many rows of x a matmul with packed low-bit weights runs in the quantized kernel: every row
    count wherever the kernels are built (none without them), each row computed alike whatever the count
    (integer dot products in passes over each group's codes), so that a row's numbers never depend on its batch.
    """
    return 0 if kernels is None else UNBOUNDED_ROWS


def default_batch_activations(kernels) -> str:
    """What `--batch-activations auto` means for these kernels: "int8" wherever AVX2 is (`avx512`,
    `avx512_vnni`, `avx2_vnni`, `avx2`: VPDPBUSD or VPMADDUBSW on the nibbles as they are, twice the products
    an instruction of the int16 path), "float32" (int16 x) in the portable build or with no kernels. One path
    serves every row count (batch invariance). With AVX-512-VNNI, int16 x was the default until its int8
    path rounded x on every thread and streamed runs of consecutive groups (2026-12-06, AMD family 26,
    default model, served side by side: int8 1.00x int16 at C=1 per stream, 1.03x at C=16, 1.08x at C=64;
    a 512-token mixed step 235-246 against 285-290 ms; docs/benchmarks/2026-12-06.md). Before that, int16
    was faster up to 16 rows there. `float32` keeps the int16 path, closer to fp32."""
    if kernels is not None and kernels.variant != "portable":
        return "int8"
    return "float32"


def quantized_matmul(kernels, int8_batch_activations: bool):
    """kernels.quantized_linear, with x rounded to int8 where asked (its last argument; from
    kernels.int8_rows_from rows: 1 wherever AVX2 is, never in the portable build): what the
    model's packed matmuls call."""
    if not int8_batch_activations:
        return kernels.quantized_linear
    return functools.partial(kernels.quantized_linear, int8_batch_activations=True)


# Written beside a build once torch has loaded it: the digest of everything the build was made from.
_BUILD_RECORD = "serval_build_key"


def _build_key(variant: Variant) -> str:
    """A digest of the sources, headers, flags and toolchain versions a variant's build is made from."""
    import torch

    digest = hashlib.sha256()
    for path in SOURCES:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    digest.update(" ".join(compile_flags(variant)).encode())  # the flags carry the headers' digest
    digest.update(f"{torch.__version__} {sys.version} {platform.machine()}".encode())
    return digest.hexdigest()


def _expected_build_directory(name: str) -> str:
    """Where torch's JIT builder puts `name` (torch.utils.cpp_extension._get_build_directory), worked out
    without importing that module: it imports setuptools, a quarter of a second of every start. Should
    torch ever place builds elsewhere, no record is found here and loading takes torch's way."""
    import torch
    from torch import _appdirs  # not imported by `import torch`: only cpp_extension imports it

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(
            os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
            f"{python}_{accelerator}",
        )
    return os.path.join(root, name)


def _load_recorded_build(name: str, key: str):
    """The module of a build torch made and loaded before from exactly these sources and flags (its record
    holds `key`), imported directly; None when there is no such build (then torch's builder decides).
    The shortcut only saves time, so any failure of it leaves the decision to torch's builder too."""
    try:
        directory = _expected_build_directory(name)
    except Exception as e:  # noqa: BLE001 - a torch that lays out its cache differently
        logger.debug("cannot tell where torch keeps kernel builds (%s); using torch's builder", e)
        return None
    library = os.path.join(directory, f"{name}.so")
    try:
        with open(os.path.join(directory, _BUILD_RECORD), encoding="utf-8") as f:
            if f.read().strip() != key or not os.path.isfile(library):
                return None
    except OSError:
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:  # a damaged library: torch's builder decides what to rebuild
        logger.debug("recorded kernel build %s did not import (%s); using torch's builder", library, e)
        return None
    return module


def _record_build(module, key: str) -> None:
    library = getattr(module, "__file__", None)
    if library is None:
        return
    directory = os.path.dirname(os.path.realpath(library))
    temporary = os.path.join(directory, f"{_BUILD_RECORD}.{os.getpid()}")
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(key)
        os.replace(temporary, os.path.join(directory, _BUILD_RECORD))  # readers never see half a key
    except OSError as e:  # a read-only cache still works, only without the shortcut
        logger.debug("could not record the kernel build in %s: %s", directory, e)


def _build_directory_exists(name: str) -> bool:
    from torch.utils.cpp_extension import _get_build_directory

    return os.path.exists(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so"))


# A build starts its compiler within seconds of taking the lock; one older than this with no process working
# in the build directory was left by a build that was killed.
_STALE_LOCK_SECONDS = 60


def _remove_stale_build_lock(name: str) -> None:
    """Remove the build lock a killed build left behind (Ctrl-C or a timeout during the first start).

    torch's builder takes the lock by creating `<build directory>/lock` and waits, without limit, for it to
    go; a build killed mid-way leaves it, and every later start would hang. A live build has a compiler or
    ninja process working in the build directory (checked through /proc, where there is one)."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = os.path.realpath(_get_build_directory(name, verbose=False))
    lock = os.path.join(directory, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except OSError:
        return
    if age < _STALE_LOCK_SECONDS or not os.path.isdir("/proc") or _process_works_in(directory):
        return
    logger.warning(
        "removing the stale kernel build lock %s (left %.0f s ago by a build that was stopped)", lock, age
    )
    try:
        os.remove(lock)
    except OSError:
        pass


def _process_works_in(directory: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == directory:
                    return True
            except OSError:
                continue  # gone, or not ours to read
    return False


def load_cpu_kernels(variant: str | None = None):
    """The compiled kernels of `variant` (default: the best this CPU runs; SERVAL_KERNEL_VARIANT overrides),
    or None when they can't be built. Asking for a variant this CPU cannot execute is a ValueError."""
    if os.environ.get("SERVAL_DISABLE_NATIVE_KERNELS") == "1":
        return None
    runnable = runnable_variants()
    name = variant or os.environ.get("SERVAL_KERNEL_VARIANT") or runnable[0].name
    chosen = variant_named(name)
    if chosen not in runnable:
        raise ValueError(
            f"kernel variant {name!r} needs CPU features {', '.join(chosen.cpu_flags)}, which this CPU lacks;"
            f" it can run: {', '.join(v.name for v in runnable)}"
        )
    module_name = f"serval_cpu_kernels_{chosen.name}"
    try:
        key = _build_key(chosen)
        recorded = _load_recorded_build(module_name, key)
        if recorded is not None:
            return recorded
        from torch.utils.cpp_extension import load

        _remove_stale_build_lock(module_name)
        first_build = not _build_directory_exists(module_name)
        if first_build:
            logger.info(
                "compiling native kernels for %s (%s variant), first start only, usually about two minutes; later"
                " starts reuse the build",
                " ".join(chosen.cpu_flags) or f"baseline {platform.machine()}",
                chosen.name,
            )
        start = time.perf_counter()
        # NOTE: torch caches the build by source hash and flags under TORCH_EXTENSIONS_DIR
        # (~/.cache/torch_extensions), one directory per variant's module name.
        module = load(
            name=module_name,
            sources=list(SOURCES),
            extra_include_paths=[_DIRECTORY],
            extra_cflags=compile_flags(chosen),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        if first_build:
            logger.info("native CPU kernels compiled in %.0f s", time.perf_counter() - start)
        _record_build(module, key)
        return module
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
