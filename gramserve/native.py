"""Small C libraries of our own: built once with the system C compiler, cached, loaded with ctypes.

`load_library(source, flags)` compiles `source` into `~/.cache/gramserve/kernels` (keyed by the source's hash, the
compiler and the flags) and loads it, or returns None (logging why once per library) where it cannot: no AVX2/FMA,
no compiler, a failed build, or GRAMSERVE_CPU_KERNELS=0. Callers then keep a torch path, so these libraries are a
speed-up, never a requirement. Users: the CPU decode kernels (`model/cpu_kernels.py`) and the CPU mask apply
(`sampling/bitmask_cpu.py`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

logger = logging.getLogger(__name__)

AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_root() -> str:
    return os.environ.get("GRAMSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "gramserve"))


def cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _build(source: str, compiler: str, flags: list[str]) -> str:
    with open(source, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + compiler.encode() + " ".join(flags).encode()).hexdigest()[:16]
    folder = os.path.join(cache_root(), "kernels")
    name = os.path.splitext(os.path.basename(source))[0]
    target = os.path.join(folder, f"{name}-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, source, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent build of the same source writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: str, flags: list[str]) -> ctypes.CDLL | None:
    """The library built from `source`, or None where it cannot be used here (the reason is logged once). Callers
    may ask every step: after the first call this is one dict lookup."""
    if source in _loaded:
        return _loaded[source]
    with _lock:
        if source in _loaded:
            return _loaded[source]
        _loaded[source] = lib = _load(source, flags)
        return lib


def _load(source: str, flags: list[str]) -> ctypes.CDLL | None:
    what = os.path.basename(source)
    if os.environ.get("GRAMSERVE_CPU_KERNELS", "1") == "0":
        logger.info("%s off (GRAMSERVE_CPU_KERNELS=0)", what)
        return None
    if not cpu_has_avx2_fma():
        logger.info("%s off: this CPU lacks AVX2/FMA", what)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("%s off: no C compiler (cc/gcc) found; torch's kernels run instead", what)
        return None
    try:
        return ctypes.CDLL(_build(source, compiler, flags))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("%s off: build failed (%s) %s", what, exc, detail.decode(errors="replace")[-500:])
        return None
