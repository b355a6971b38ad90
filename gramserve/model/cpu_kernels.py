"""The CPU decode kernels of `cpu_kernels.c`: built once with the system C compiler, cached, loaded with ctypes.

The library is built for AVX2 + FMA; its matmul and decode attention also carry AVX-512 versions that it picks at
run time where the CPU has AVX-512 (`use_avx512` tells, and turns them off for a comparison).

The library links libgomp by its soname, so in a process that imported torch it shares torch's OpenMP runtime
(one thread pool; --num-threads sets the count for both).

`load()` returns None where they cannot run (`gramserve.native` says when, and builds and caches the library).
Callers then keep the plain torch path, so the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import os

import torch

from gramserve.native import AVX2_FLAGS, load_library

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.c")
FLAGS = [*AVX2_FLAGS, "-fopenmp"]

_threads = 1


def set_threads(n: int) -> None:
    """Threads each kernel call uses (the runner sets it from --cpu-kernel-threads)."""
    global _threads
    _threads = max(1, int(n))


def threads() -> int:
    return _threads


def load() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot be used here (`gramserve.native` logs why once)."""
    lib = load_library(SOURCE, FLAGS)
    if lib is not None and lib.gs_qgemm.argtypes is None:
        _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
    lib.gs_qgemm.argtypes = [i, p, i, i, p, p, p, i, p, i]
    lib.gs_qgemm.restype = i
    lib.gs_rmsnorm.argtypes = [p, p, p, f, i, i, p]
    lib.gs_rmsnorm.restype = None
    lib.gs_decode_attention.argtypes = [p, p, p, p, i64, p, p, i, i, i, i, f, p, i]
    lib.gs_decode_attention.restype = i
    lib.gs_rope_store.argtypes = [p, i, i, i, i, p, p, p, p, p, p, p]
    lib.gs_rope_store.restype = None
    lib.gs_silu_mul.argtypes = [p, i, i, p]
    lib.gs_silu_mul.restype = None
    lib.gs_decode_layers.argtypes = [p, i, i, i, i, i, i, i, f, f, p, p, p, p, p, p, p, i64, p, p, p, p, i]
    lib.gs_decode_layers.restype = i
    lib.gs_use_avx512.argtypes = [i]
    lib.gs_use_avx512.restype = i


def use_avx512(lib: ctypes.CDLL, on: bool | None = None) -> bool:
    """Whether matmuls of 4 rows or more take the AVX-512 path (where the CPU has it); `on` turns it on or off."""
    return bool(lib.gs_use_avx512(-1 if on is None else int(on)))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def qgemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    bits: int,
    qs: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | None,
    n: int,
    threads: int,
) -> torch.Tensor:
    """x [M, K] float32 contiguous @ the block-quantized [n, K] weight^T -> [M, n] float32."""
    y = torch.empty((x.shape[0], n), dtype=torch.float32)
    rc = lib.gs_qgemm(bits, x.data_ptr(), x.shape[0], x.shape[1], qs.data_ptr(), d.data_ptr(), _ptr(m), n,
                      y.data_ptr(), threads)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"gs_qgemm failed ({rc})")
    return y


def rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    """rmsnorm(x) [* weight]; with `residual` (updated in place to x + residual): rmsnorm of the sum."""
    out = torch.empty_like(x)
    lib.gs_rmsnorm(x.data_ptr(), _ptr(residual), weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr())
    return out


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    threads: int,
) -> torch.Tensor:
    """q [B, Hq, D] contiguous; caches [slots, Hkv, D]; table int32; rows and lens int64 [B]."""
    b, hq, dim = q.shape
    rows, lens = rows.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    out = torch.empty((b, hq * dim), dtype=torch.float32)
    rc = lib.gs_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                                 table.stride(0), rows.data_ptr(), lens.data_ptr(), b, hq, k_cache.shape[1], dim,
                                 scale, out.data_ptr(), threads)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"gs_decode_attention failed ({rc})")
    return out


def rope_and_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """RoPE on q and k of qkv [T, (Hq + 2 Hkv) * D] (contiguous) with k and v stored at `loc`; returns q [T, Hq, D].
    positions and loc: int64."""
    t, dim = qkv.shape[0], k_cache.shape[-1]
    positions, loc = positions.to(torch.int64).contiguous(), loc.to(torch.int64).contiguous()
    q = torch.empty((t, num_heads, dim), dtype=torch.float32)
    lib.gs_rope_store(qkv.data_ptr(), t, num_heads, num_kv_heads, dim, cos.data_ptr(), sin.data_ptr(),
                      positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), loc.data_ptr(),
                      q.data_ptr())  # fmt: skip
    return q


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (contiguous) -> [T, I]."""
    t, width = gate_up.shape
    out = torch.empty((t, width // 2), dtype=torch.float32)
    lib.gs_silu_mul(gate_up.data_ptr(), t, width // 2, out.data_ptr())
    return out
