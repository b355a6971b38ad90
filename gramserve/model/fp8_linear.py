"""FP8 weights (`--quantization fp8`): the decoder's projections in float8 e4m3, one scale per output channel.

At each call the activations are quantized per token (one scale a row: its largest magnitude maps to 448, e4m3's
largest value), and one scaled GEMM (`torch._scaled_mm`, cuBLASLt's FP8 kernels on Hopper) multiplies the two and
applies both scales, in float32, to a bf16 output. Half the weight bytes of bf16 and twice its tensor-core rate,
so decode at small batches reads half the bytes and large batches and prefill compute at up to twice the rate.
The embeddings, norms and lm_head keep the model's dtype (as vLLM's and SGLang's `fp8` do); so does any projection
whose sizes are not multiples of 16 (the GEMM's requirement).

The activation quantization is one Triton kernel on CUDA (a row's max, then the scaled cast); elsewhere the same
arithmetic in torch ops, which the CPU runs too, slowly: the CPU twin that tests check the arithmetic with.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row still gets a finite scale
_WEIGHT_ROWS_PER_PASS = 4096  # weight rows quantized at a time: bounds the float32 temporary


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight in e4m3 and its float32 scale per output row ([N]): weight ~= q * scale[:, None]."""
    q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], _WEIGHT_ROWS_PER_PASS):
        rows = weight[lo : lo + _WEIGHT_ROWS_PER_PASS].float()
        s = (rows.abs().amax(dim=1) / FP8_MAX).clamp_(min=_MIN_SCALE)
        q[lo : lo + _WEIGHT_ROWS_PER_PASS] = (rows / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        scale[lo : lo + _WEIGHT_ROWS_PER_PASS] = s
    return q, scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with x ~= q * scale, in torch ops."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of a contiguous [M, K] activation: the Triton kernel on CUDA, torch elsewhere."""
    if x.is_cuda:
        from gramserve.model.fp8_kernels import quantize_rows_triton

        return quantize_rows_triton(x)
    return quantize_rows_torch(x)


class Fp8Linear(nn.Module):
    """y = x @ W.T (+ bias) with W in e4m3 ([N, K], `weight`) and its scales per output row (`weight_scale`)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.reshape(1, -1).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Module) -> Fp8Linear:
        q, scale = quantize_weight(linear.weight.detach())
        return cls(q, scale, linear.bias)

    @staticmethod
    def supports(linear: nn.Module) -> bool:
        n, k = linear.weight.shape
        return n % 16 == 0 and k % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] == 0:
            return x.new_empty(*shape[:-1], self.weight.shape[0])
        q, scale = quantize_rows(x2.contiguous())
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], -1)

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in_features={k}, out_features={n}, e4m3 with a scale per output row"


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """On CUDA, FP8 GEMMs with a scale per row need a Hopper-class GPU (compute capability 9.0) and a bf16 output."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0):
        raise ValueError(
            f"--quantization fp8 needs a GPU of compute capability 9.0 or newer (Hopper); this one is {major}.{minor}"
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantization fp8 on a GPU needs --dtype bfloat16 (the FP8 GEMM's output), not {dtype}")


def use_fp8_weights(model: nn.Module) -> tuple[int, int]:
    """Swap every decoder projection (q/k/v, o, gate/up, down) of `model.layers` for an Fp8Linear, freeing the
    floats as it goes. Returns (projections swapped, projections kept in floats)."""
    swapped = kept = 0
    for layer in model.layers:
        for owner, attr in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            linear = getattr(owner, attr)
            if not Fp8Linear.supports(linear):
                kept += 1
                continue
            setattr(owner, attr, Fp8Linear.of(linear))
            del linear
            swapped += 1
    if kept:
        logger.warning("--quantization fp8: %d projections keep their float weights (sizes not multiples of 16)", kept)
    return swapped, kept
