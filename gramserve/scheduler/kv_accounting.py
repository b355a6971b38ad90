"""KV slot accounting of the running requests: slots reserved and available, allocation with eviction, release.

Wraps the slot allocator, the request slot table (memory.py) and the radix prefix cache (radix_cache.py): a request's
slots are its own until it releases them, then the prefix cache owns what it computed.
"""

from __future__ import annotations

import torch

from gramserve.scheduler.memory import ReqToTokenPool, TokenSlotAllocator
from gramserve.scheduler.radix_cache import RadixCache
from gramserve.scheduler.request import Req


class KvAccounting:
    """Who may take KV slots: admission asks what is available and reserved, batches allocate, finishes release."""

    def __init__(
        self, allocator: TokenSlotAllocator, req_pool: ReqToTokenPool, cache: RadixCache, reserve_ratio: float
    ):
        self.allocator = allocator
        self.req_pool = req_pool
        self.cache = cache
        self.reserve_ratio = reserve_ratio  # share of a request's remaining new tokens kept free for it

    def reserved(self, running: list[Req]) -> int:
        """Slots kept free for the tokens that running requests are still expected to generate."""
        return int(sum(r.remaining_new_tokens() for r in running) * self.reserve_ratio)

    def available(self) -> int:
        return self.allocator.num_free + self.cache.evictable_size

    def alloc(self, n: int) -> torch.Tensor:
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def release(self, req: Req) -> None:
        """Give a request's KV back: computed tokens go into the prefix cache, duplicates are freed."""
        if req.req_pool_idx is None:
            return
        slots = self.req_pool.slots(req.req_pool_idx, req.kv_len)
        computed = min(req.kv_len, len(req.fill_ids))  # K/V past fill_ids: a step whose token never came
        self.allocator.free(slots[computed:])
        slots = slots[:computed]
        already = self.cache.insert(req.fill_ids[:computed], slots, req.cache_namespace) if computed else 0
        dup_end = max(already, req.prefix_len)
        self.allocator.free(slots[req.prefix_len : dup_end])  # our own copies of what the tree already had
        if self.cache.disabled:
            self.allocator.free(slots[req.prefix_len :])
        if req.prefix_node is not None:
            self.cache.unlock(req.prefix_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.prefix_node = None, None
        req.kv_len = req.prefix_len = 0
