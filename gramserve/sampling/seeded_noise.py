"""Exponential noise for seeded requests: a pure function of (seed, step, token id), computed on the device.

Sampling draws `argmax(probs / noise)` with Exp(1) noise (the exponential race, equal to sampling from `probs`).
A seeded request's noise must not depend on its batch, its row, or the device, so it cannot come from a shared
generator. A generator per request held on the CPU did that, at the cost of a 128k-value CPU draw and a copy
per row and step (300 ms a step for 100 seeded rows on an H100 host). Here each value is a counter-based hash
(splitmix64's finalizer) of the seed, the number of tokens generated so far and the token id, done with int64
tensor ops for all seeded rows at once on the logits' device: the same bits on the CPU and on a GPU.
"""

from __future__ import annotations

import torch

_U64 = 1 << 64


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 that has its bits (torch integer ops wrap like C's)."""
    c %= _U64
    return c - _U64 if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_STEP = _signed(0xD1B54A32D192ED03)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _mix_inplace(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (every input bit reaches every output bit), in place (`tmp`: scratch of the same
    shape): no new [rows, vocab] int64 tensor per operation (on a CPU the allocations cost more than the arithmetic)."""
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1
        z ^= tmp
        if mul is not None:
            z *= mul
    return z


def _mix(z: torch.Tensor) -> torch.Tensor:
    """`_mix_inplace` on a copy."""
    return _mix_inplace(z.clone(), torch.empty_like(z))


def seeded_exponential(seeds: list[int], steps: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seeds), vocab] float32 Exp(1) noise; row i depends only on (seeds[i], steps[i])."""
    s = torch.tensor([_signed(x) for x in seeds], dtype=torch.int64, device=device)[:, None]
    t = torch.tensor(steps, dtype=torch.int64, device=device)[:, None]
    # A start per (seed, step), mixed so that rows of nearby seeds or steps are not shifted copies of each other.
    start = _mix(_mix(s * _GOLDEN + _GOLDEN) + t * _STEP)
    z = torch.arange(vocab, dtype=torch.int64, device=device).mul_(_GOLDEN).expand(len(seeds), vocab) + start
    tmp = torch.empty_like(z)
    _mix_inplace(z, tmp)
    bits = torch.bitwise_right_shift(z, 11, out=tmp).bitwise_and_((1 << 53) - 1)
    u = bits.to(torch.float64).add_(0.5).mul_(1.0 / (1 << 53))  # uniform in (0, 1), never 0 or 1
    return u.log_().neg_().to(torch.float32)
