"""Flatten each request's KV slots (its req_to_token row, first seq_len entries) into one index array on the GPU.

FlashInfer's paged layout with page size 1 wants exactly this: `kv_indices[kv_indptr[i]:kv_indptr[i+1]]` are
request i's slots. One small Triton program per request, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows(table, table_stride, rows, seq_lens, indptr, out, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(rows + pid).to(tl.int64)
    n = tl.load(seq_lens + pid)
    start = tl.load(indptr + pid)
    for off in range(0, n, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < n
        vals = tl.load(table + row * table_stride + idx, mask=m)
        tl.store(out + start + idx, vals, mask=m)


def build_kv_indices(
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """rows, seq_lens, indptr ([B + 1]) on the GPU; writes int32 slots into out[:indptr[-1]]."""
    bs = rows.numel()
    if bs:
        _gather_rows[(bs,)](req_to_token, req_to_token.stride(0), rows, seq_lens, indptr, out, BLOCK=512)
    return out
