"""Block-quantized weights for the CPU decode kernels: read from a GGUF as they are stored, or made from floats.

A GGUF's Q4_1 / Q8_0 tensors are repacked (scales and offsets to float32 arrays, the codes as they are) and kept
only where they reproduce, value for value, the float weight that transformers' GGUF conversion gave the model;
that check also finds the row order transformers applies to q and k. So the quantized path computes with the
very weights of the float model, only in fewer bytes. `quantize_q8_0` makes Q8_0 blocks from any float weight
(`--cpu-weights q8_0`): 8.5 bits a weight, a small rounding of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK = 32
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class BlockWeight:
    """An [n, k] weight in blocks of 32 along k. bits 4: value = d * q + m (q in 0..15, two per byte);
    bits 8: value = d * q (q int8)."""

    bits: int
    qs: torch.Tensor  # uint8 [n, k/32, 16] or int8 as uint8 [n, k/32, 32]
    d: torch.Tensor  # float32 [n, k/32]
    m: torch.Tensor | None  # float32 [n, k/32] for bits 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def dequantize(self) -> torch.Tensor:
        q = self.qs
        if self.bits == 4:
            codes = torch.cat([q & 15, q >> 4], dim=-1).float()
            return (self.d[..., None] * codes + self.m[..., None]).reshape(self.shape)
        return (self.d[..., None] * q.view(torch.int8).float()).reshape(self.shape)

    def rows(self, order: torch.Tensor) -> "BlockWeight":
        pick = lambda t: None if t is None else t[order].contiguous()  # noqa: E731
        return BlockWeight(self.bits, pick(self.qs), pick(self.d), pick(self.m))

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Row-wise concatenation (how qkv_proj and gate_up_proj are fused)."""
        bits = {p.bits for p in parts}
        if len(bits) != 1:
            raise ValueError("mixed block formats")
        ms = [p.m for p in parts]
        return BlockWeight(
            bits.pop(),
            torch.cat([p.qs for p in parts]),
            torch.cat([p.d for p in parts]),
            None if ms[0] is None else torch.cat(ms),
        )


def _from_gguf_tensor(kind: str, raw: np.ndarray) -> BlockWeight | None:
    n = raw.shape[0]
    if kind == "Q4_1":
        b = raw.reshape(n, -1, 20)
        d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
        m = np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        return BlockWeight(
            4, torch.from_numpy(np.ascontiguousarray(b[:, :, 4:])), torch.from_numpy(d), torch.from_numpy(m)
        )
    if kind == "Q8_0":
        b = raw.reshape(n, -1, 34)
        d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
        return BlockWeight(8, torch.from_numpy(np.ascontiguousarray(b[:, :, 2:])), torch.from_numpy(d), None)
    return None


def _match_rows(blocks: BlockWeight, reference: torch.Tensor) -> BlockWeight | None:
    """The blocks in the row order of `reference`, or None unless every row is reproduced exactly."""
    ours = blocks.dequantize()
    if ours.shape != reference.shape:
        return None
    if torch.equal(ours, reference):
        return blocks
    where = {row.numpy().tobytes(): i for i, row in enumerate(ours)}
    order = [where.get(row.numpy().tobytes(), -1) for row in reference]
    if -1 in order:
        return None
    return blocks.rows(torch.tensor(order))


def read_gguf_blocks(gguf_path: str, float_weights: dict[str, torch.Tensor]) -> dict[str, BlockWeight]:
    """HF weight name -> blocks, for every Q4_1 / Q8_0 tensor of the GGUF that reproduces `float_weights`."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    out: dict[str, BlockWeight] = {}
    skipped = []
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        else:
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_NAMES:
                continue
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
        blocks = _from_gguf_tensor(t.tensor_type.name, np.asarray(t.data))
        ref = float_weights.get(name)
        if blocks is None or ref is None:
            skipped.append(f"{t.name} ({t.tensor_type.name})")
            continue
        matched = _match_rows(blocks, ref.float())
        if matched is None:
            skipped.append(f"{t.name} (does not reproduce the converted weight)")
            continue
        out[name] = matched
    if skipped:
        logger.info("GGUF tensors kept as floats: %d (%s)", len(skipped), ", ".join(skipped[:4]))
    return out


def save_blocks(path: str, blocks: dict[str, BlockWeight]) -> None:
    """Write blocks to a safetensors file (atomically), so a restart skips reading and checking the GGUF."""
    import os
    import tempfile

    from safetensors.torch import save_file

    tensors = {}
    for name, b in blocks.items():
        tensors[f"{name}.q{b.bits}"] = b.qs
        tensors[f"{name}.d"] = b.d
        if b.m is not None:
            tensors[f"{name}.m"] = b.m
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=os.path.dirname(path))
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_blocks(path: str) -> dict[str, BlockWeight]:
    from safetensors.torch import load_file

    tensors = load_file(path)
    out = {}
    for key, qs in tensors.items():
        for bits in (4, 8):
            if key.endswith(f".q{bits}"):
                name = key[: -len(f".q{bits}")]
                out[name] = BlockWeight(bits, qs, tensors[f"{name}.d"], tensors.get(f"{name}.m"))
    return out


def gguf_blocks(gguf_path: str, float_weights: dict[str, torch.Tensor], cache_file: str) -> dict[str, BlockWeight]:
    """read_gguf_blocks, kept in `cache_file` (next to the converted model, keyed like it by the GGUF)."""
    import os

    if os.path.exists(cache_file):
        try:
            blocks = load_blocks(cache_file)
            if all(tuple(float_weights[n].shape) == b.shape for n, b in blocks.items() if n in float_weights):
                return blocks
        except Exception as exc:  # a damaged cache file is rebuilt
            logger.warning("ignoring %s: %s", cache_file, exc)
    blocks = read_gguf_blocks(gguf_path, float_weights)
    try:
        save_blocks(cache_file, blocks)
    except OSError as exc:
        logger.warning("could not cache the GGUF blocks in %s: %s", cache_file, exc)
    return blocks


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Q8_0 blocks of a float [n, k] weight (k a multiple of 32): d = max|w| / 127 per block."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = w.abs().amax(-1) / 127.0
    q = torch.where(d[..., None] > 0, w / d[..., None].clamp(min=1e-30), torch.zeros_like(w)).round().clamp(-127, 127)
    return BlockWeight(8, q.to(torch.int8).view(torch.uint8).contiguous(), d.contiguous(), None)
