"""Tensor parallelism: which share of every layer a rank holds (`Partition`) and the collectives between ranks
(`TPGroup`).

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its own attention heads and its own
slice of the MLP's intermediate features), o_proj and down_proj are row-parallel (each rank's partial sums are
added by one all-reduce per projection), the embedding and the lm_head are split by vocabulary rows (the embedding's
partial rows are added by an all-reduce, the logits' columns gathered). Heads are split by KV head: rank r takes a
contiguous run of KV heads and the query heads that read them, so a count that does not divide evenly (SmolLM2's
3 KV heads over 2 ranks) is split as evenly as it can be. Norms and RoPE tables are replicated.

Collectives run over torch.distributed: NCCL on GPUs (NVLink multicast off), gloo on a CPU. A size-1 group does
nothing, so the single-device model pays only a method call.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gramserve.model.model_config import ModelConfig, UnsupportedModelError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPConfig:
    """One rank's place in its tensor-parallel group."""

    size: int = 1
    rank: int = 0
    init_method: str = ""  # tcp://host:port of rank 0's store; "" with size 1
    device_index: int = 0  # CUDA device of this rank
    channel_host: str = "127.0.0.1"  # where followers reach rank 0's step channel (model/tp_step.py)
    one_host: bool = True  # every rank on this host: CPU collectives go through shared memory


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items are split into `parts` runs that differ in length by at most 1."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class Partition:
    """The share of the model that rank `rank` of `size` holds."""

    rank: int
    size: int
    kv_heads: tuple[int, int]  # [start, end) of the KV heads
    q_heads: tuple[int, int]
    intermediate: tuple[int, int]  # MLP features
    vocab: tuple[int, int]  # embedding / lm_head rows that hold real tokens
    vocab_per_rank: int  # rows of every rank's shard (the last one's tail padded with zeros)
    head_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> Partition:
        if size > cfg.num_kv_heads:
            raise UnsupportedModelError(
                f"tp_size {size} is more than the model's {cfg.num_kv_heads} KV heads; use at most {cfg.num_kv_heads}"
            )
        group = cfg.num_heads // cfg.num_kv_heads
        kv = split_range(cfg.num_kv_heads, size, rank)
        per = -(-cfg.vocab_size // size)
        vocab = (min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size))
        return cls(
            rank,
            size,
            kv,
            (kv[0] * group, kv[1] * group),
            split_range(cfg.intermediate_size, size, rank),
            vocab,
            per,
            cfg.head_dim,
        )

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    def _heads(self, heads: tuple[int, int]) -> slice:
        return slice(heads[0] * self.head_dim, heads[1] * self.head_dim)

    def slice_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of the HF-named weight `name` (the whole tensor where it is replicated)."""
        if self.size == 1:
            return tensor
        proj = name.split(".")[-2] if "." in name else name
        if proj == "q_proj":
            return tensor[self._heads(self.q_heads)]
        if proj in ("k_proj", "v_proj"):
            return tensor[self._heads(self.kv_heads)]
        if proj in ("gate_proj", "up_proj"):
            return tensor[slice(*self.intermediate)]
        if proj == "o_proj":
            return tensor[:, self._heads(self.q_heads)]
        if proj == "down_proj":
            return tensor[:, slice(*self.intermediate)]
        if proj in ("embed_tokens", "lm_head"):
            return self._vocab_rows(tensor)
        return tensor

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor[slice(*self.vocab)]
        if rows.shape[0] == self.vocab_per_rank:
            return rows
        padded = tensor.new_zeros((self.vocab_per_rank, *tensor.shape[1:]))
        padded[: rows.shape[0]] = rows
        return padded

    def slice_fused(self, name: str, full: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """This rank's share of our (fused) parameter `name`, given the whole of it as one device would hold it."""
        if self.size == 1:
            return full
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            qw, kw, vw = full.split([q, kv, kv])
            parts = [("q_proj", qw), ("k_proj", kw), ("v_proj", vw)]
            return torch.cat([self.slice_hf(f"{p}.weight", t) for p, t in parts])
        if ".gate_up_proj." in name:
            gate, up = full.chunk(2)
            return torch.cat([self.slice_hf("gate_proj.weight", gate), self.slice_hf("up_proj.weight", up)])
        for proj in ("o_proj", "down_proj", "embed_tokens", "lm_head"):
            if f"{proj}." in name:
                return self.slice_hf(f"{proj}.weight", full)
        return full


class TPGroup:
    """The collectives of one tensor-parallel group (this process's rank in it). Size 1: no-ops."""

    def __init__(self, config: TPConfig | None = None, device: torch.device | None = None):
        self.config = config = config or TPConfig()
        self.size, self.rank = config.size, config.rank
        self.device = device or torch.device("cpu")
        self.cpu_group = None
        self.shm = None  # one host's CPU ranks: shared-memory collectives (model/shm_collectives.py)
        if self.size == 1:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the GPU hosts' notes say why)
        dist.init_process_group(
            backend,
            init_method=config.init_method,
            world_size=self.size,
            rank=self.rank,
            timeout=datetime.timedelta(minutes=30),  # a long first load on another node
        )
        # Small host-side exchanges (the KV pool size, the step channel's address) go over gloo on every device.
        self.cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        if backend == "gloo" and config.one_host:
            from gramserve.model.shm_collectives import ShmCollectives

            self.shm = ShmCollectives(self.rank, self.size, None if self.is_driver else self.broadcast_object())
            if self.is_driver:
                self.broadcast_object(self.shm.name)
            dist.barrier(group=self.cpu_group)
            if self.is_driver:
                self.shm.unlink()
            backend = "shared memory"
        logger.info("tensor parallel rank %d of %d joined (%s)", self.rank, self.size, backend)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that schedules, samples and talks to the rest of the server."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, per] on every rank -> [rows, size * per] (rank order), cut to `width` columns."""
        if self.size == 1:
            return x[:, :width] if x.shape[1] != width else x
        x = x.contiguous()
        if self.shm is not None:
            out = self.shm.all_gather(x)
        elif x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
            out = torch.stack(parts)
        return out.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :width]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype on every rank)."""
        if self.shm is not None:
            return self.shm.broadcast(x)
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool is sized to fit on every rank)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj=None):
        """Rank 0's picklable `obj` to every rank (host side)."""
        if self.size == 1:
            return obj
        data = pickle.dumps(obj) if self.is_driver else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_driver else None
        if buf is None:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cpu_group)
        return pickle.loads(buf.numpy().tobytes())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
