"""Forward batches: the device inputs of a prefill (extend) step or a decode step, their KV slots allocated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gramserve.model.forward_batch import ForwardBatch, ForwardMode
from gramserve.model.lora.batch import LoRABatch, make_lora_batch
from gramserve.scheduler.image_encoder import ImageEncoder
from gramserve.scheduler.kv_accounting import KvAccounting
from gramserve.scheduler.request import Req


@dataclass
class _DecodeRows:
    """The device tensors of the last decode batch. The next decode batch of the same requests, each one token on
    (steady decode), reuses them: its positions are these seq_lens."""

    reqs: list[Req]
    seq_lens: list[int]
    rows_dev: torch.Tensor
    seq_lens_dev: torch.Tensor
    lora: LoRABatch | None


class BatchBuilder:
    """Builds each step's ForwardBatch; a steady decode step reuses the last one's device rows."""

    def __init__(
        self,
        kv: KvAccounting,
        device: torch.device,
        last_tokens: torch.Tensor,
        lora: bool = False,
        images: ImageEncoder | None = None,
    ):
        self.kv = kv
        self.lora = lora  # LoRA on: batches carry their adapter segments
        self.images = images  # a vision-language model: prefill batches carry their images' features
        self.req_pool = kv.req_pool
        self.device = device
        # The last sampled token of each request row (written by sampling): a decode step's input ids.
        self.last_tokens = last_tokens
        self._last_decode: _DecodeRows | None = None

    def prefill(self, picked: list[tuple[Req, int]], riders: list[Req] = ()) -> ForwardBatch:
        """Extend each picked request by its number of new tokens (its next prompt chunk, or its whole rest), and
        each running request of `riders` by one token (mixed decode), after them. A rider's input is the token it
        sampled last, read from `last_tokens` on the device: under overlap it has not reached the host yet."""
        prompt_tokens = sum(n for _, n in picked)
        slots = self.kv.alloc(prompt_tokens + len(riders))
        embeds = self.images.embeds(picked) if self.images is not None else None  # before kv_len moves on
        ids, positions, rows, prefix_lens, new_lens = [], [], [], [], []
        offset = 0
        for req, n in picked:
            start = req.kv_len
            self.req_pool.write(req.req_pool_idx, start, slots[offset : offset + n])
            offset += n
            ids += req.fill_ids[start : start + n]
            positions.append(torch.arange(start, start + n))
            rows.append(req.req_pool_idx)
            prefix_lens.append(start)
            new_lens.append(n)
            req.kv_len += n
        if riders:
            rider_positions = [r.kv_len for r in riders]
            rider_rows = self.to_device([r.req_pool_idx for r in riders])
            # One scatter for the riders (a write per request costs a kernel launch each on a GPU).
            table = self.req_pool.table
            table[rider_rows, self.to_device(rider_positions)] = slots[prompt_tokens:].to(table.dtype)
            for req in riders:
                req.kv_len += 1
            ids = torch.cat([self.to_device(ids), self.last_tokens[rider_rows]])
            positions.append(torch.tensor(rider_positions, dtype=torch.long))
            rows += [r.req_pool_idx for r in riders]
            prefix_lens += rider_positions
            new_lens += [1] * len(riders)
        batch = self._make_batch(
            ForwardMode.EXTEND,
            ids,
            torch.cat(positions),
            slots,
            rows,
            [p + n for p, n in zip(prefix_lens, new_lens)],
            prefix_lens,
            new_lens,
        )
        if self.lora:
            batch.lora = make_lora_batch([r.lora_slot for r, _ in picked], self.device, new_lens)
        batch.input_embeds = embeds
        return batch

    def decode(self, reqs: list[Req]) -> ForwardBatch:
        """One token on for each request."""
        slots = self.kv.alloc(len(reqs))
        positions = [r.kv_len for r in reqs]
        for req in reqs:
            req.kv_len += 1
        last = self._last_decode
        if last is not None and reqs == last.reqs and positions == last.seq_lens:
            # The same requests as the last decode step, one token on: no host-to-device copies.
            rows_dev, positions_dev, lora = last.rows_dev, last.seq_lens_dev, last.lora
        else:
            rows_dev = self.to_device([r.req_pool_idx for r in reqs])
            positions_dev = self.to_device(positions)
            lora = make_lora_batch([r.lora_slot for r in reqs], self.device) if self.lora else None
        seq_lens, seq_lens_dev = [p + 1 for p in positions], positions_dev + 1
        self._last_decode = _DecodeRows(reqs, seq_lens, rows_dev, seq_lens_dev, lora)
        # One scatter for the whole batch (a write per request costs a kernel launch each on a GPU).
        self.req_pool.table[rows_dev, positions_dev] = slots.to(self.req_pool.table.dtype)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            # Each request's input is the token it sampled last, which may still be on the device (overlap).
            input_ids=self.last_tokens[rows_dev],
            positions=positions_dev,
            out_cache_loc=slots,
            req_pool_indices=rows_dev,
            seq_lens=seq_lens_dev,
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=positions,
            extend_seq_lens_cpu=[1] * len(reqs),
            req_to_token=self.req_pool.table,
            lora=lora,
        )

    def to_device(self, values: list[int]) -> torch.Tensor:
        # non_blocking: a plain host-to-device copy would wait for every kernel already queued (overlap).
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _make_batch(self, mode, ids, positions, locs, rows, seq_lens, prefix_lens, new_lens) -> ForwardBatch:
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=ids if isinstance(ids, torch.Tensor) else self.to_device(ids),
            positions=positions.to(dev, non_blocking=True),
            out_cache_loc=locs.to(dev),
            req_pool_indices=self.to_device(rows),
            seq_lens=self.to_device(seq_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=new_lens,
            req_to_token=self.req_pool.table,
        )
