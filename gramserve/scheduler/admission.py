"""Admission: the waiting queue's order (lpm / fcfs, priority), which requests prefill next and how much of each
(chunked prefill), and retraction when decode runs out of KV slots."""

from __future__ import annotations

import logging
from collections import deque

from gramserve.messages import FinishReason
from gramserve.model.lora.adapter import LoRAAdapterError
from gramserve.scheduler.kv_accounting import KvAccounting
from gramserve.scheduler.lora_slots import LoRASlots
from gramserve.scheduler.radix_cache import MatchResult
from gramserve.scheduler.request import Req
from gramserve.scheduler.stats import SchedulerCounters

logger = logging.getLogger(__name__)

LPM_WINDOW = 128  # waiting requests scored by prefix match per step, or passed over as too long (bounds the cost)


class Admission:
    """The waiting queue and the request being prefilled chunk by chunk."""

    def __init__(
        self,
        kv: KvAccounting,
        schedule_policy: str,
        chunked_prefill_size: int,
        max_prefill_tokens: int,
        counters: SchedulerCounters,
        lora: LoRASlots | None = None,
    ):
        self.kv = kv
        self.cache = kv.cache
        self.req_pool = kv.req_pool
        self.schedule_policy = schedule_policy
        self.chunk_size = chunked_prefill_size  # tokens per extend step; 0 or less: whole prompts
        self.max_prefill_tokens = max_prefill_tokens
        self.counters = counters
        self.lora = lora
        self.failed: list[Req] = []  # left the queue with an error (their adapter could not be read again)
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # the request whose prompt is being prefilled chunk by chunk
        # How many more requests whose grammar compiles (Req.grammar_pending) this pick may admit: each parks its
        # last logits row on the device until the grammar is ready (set by the scheduler before each pick).
        self.pending_room = 0

    def withdraw(self, rid: str) -> Req | None:
        """Take a waiting or partly prefilled request out (an abort)."""
        req = next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.waiting.remove(req)
        elif self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
        return req

    def clear(self) -> None:
        self.waiting, self.chunked = deque(), None

    def ordered_waiting(self) -> list[Req]:
        if self.schedule_policy == "lpm" and not self.cache.disabled and len(self.waiting) > 1:
            head = list(self.waiting)[:LPM_WINDOW]
            hit = {id(r): self.cache.match_prefix(r.fill_ids[:-1], r.cache_namespace).length for r in head}
            head.sort(key=lambda r: (-hit[id(r)], r.priority, r.arrival))
            return head + list(self.waiting)[LPM_WINDOW:]
        return sorted(self.waiting, key=lambda r: (r.priority, r.arrival))

    def schedule_prefill(self, running: list[Req]) -> list[tuple[Req, int]]:
        """Pick (request, new tokens) pairs for one extend step within the token and memory budgets. The picked
        requests leave the waiting queue with their slot-table row and cached prefix."""
        if not (self.waiting or self.chunked):
            return []
        budget = self.chunk_size if self.chunk_size > 0 else self.max_prefill_tokens
        picked: list[tuple[Req, int]] = []
        chunked = self.chunked
        if chunked is None:
            self._pick_waiting(picked, budget, running, whole_only=False)
            return picked
        # A long prompt's chunks would take every step's budget and hold each new request back for the whole
        # prefill (on a CPU, tens of seconds): new prompts that fit whole in half the budget go first, and the
        # chunked request takes the rest, at least half, so it keeps going. They count it as running, and leave
        # the KV free for the rest of its prompt.
        rest = len(chunked.fill_ids) - chunked.kv_len
        taken = self._pick_waiting(picked, budget // 2, running + [chunked], whole_only=True, keep_free=rest)
        take = min(rest, budget - taken, self.kv.available() - taken)
        if take > 0:  # else wait for running requests to finish and free memory
            picked.insert(0, (chunked, take))
        if take == rest and taken + take < budget:  # its last chunk: the rest of the budget goes to the queue
            self._pick_waiting(
                picked, budget - taken - take, running + [chunked], whole_only=False, keep_free=taken + take
            )
        return picked

    def _pick_waiting(
        self, picked: list[tuple[Req, int]], budget: int, running: list[Req], whole_only: bool, keep_free: int = 0
    ) -> int:
        """Admit waiting requests in policy order into `picked` within `budget` new tokens; the last one may be
        cut into a chunk (it becomes `chunked`) unless `whole_only`. `keep_free` KV slots stay out of their reach.
        Returns the tokens taken."""
        chunk_size = self.chunk_size
        available = self.kv.available
        reserved = self.kv.reserved(running) + keep_free
        ratio = self.kv.reserve_ratio
        taken = skipped = 0
        rows_left = self.req_pool.num_free
        active = None  # adapters of the running and picked requests (LoRA only)
        for req in self.ordered_waiting():
            if budget <= 0 or rows_left == 0 or skipped == LPM_WINDOW:
                break
            if req.lora_id and self.lora is not None:
                if active is None:
                    active = {r.lora_id for r in running if r.lora_id}
                    active.update(r.lora_id for r, _ in picked if r.lora_id)
                if not self.lora.fits(req.lora_id, active):
                    continue  # its adapter waits for a free slot (--max-loras-per-batch)
                if not self._lora_ready(req):
                    continue  # its adapter is being read again, or could not be (failed)
            if req.grammar_pending and self.pending_room <= 0:
                continue  # it waits for its compile in the queue, as without room to park
            match = self.cache.match_prefix(req.fill_ids[:-1], req.cache_namespace)
            extend = len(req.fill_ids) - match.length
            if whole_only and extend > budget:
                skipped += 1  # a long prompt waits for the chunked one; shorter ones behind it may still fit
                continue
            take = min(extend, budget) if chunk_size > 0 else extend
            if chunk_size <= 0 and picked and take > budget:
                break
            reserve = int(req.remaining_new_tokens() * ratio) if take == extend else 0
            self.cache.lock(match.node)  # locking makes the matched prefix unevictable: count it first
            room = available() - taken
            if take > room or (take + reserve > room - reserved and (picked or running)):
                self.cache.unlock(match.node)
                break
            if req.lora_id and self.lora is not None:
                req.lora_slot = self.lora.acquire(req.lora_id, active)
                active.add(req.lora_id)
            self.waiting.remove(req)
            self._admit(req, match)
            self.pending_room -= req.grammar_pending
            picked.append((req, take))
            taken += take
            reserved += reserve
            budget -= take
            rows_left -= 1
            if take < extend:
                self.chunked = req
                break
        return taken

    def _lora_ready(self, req: Req) -> bool:
        try:
            return self.lora.ready(req.lora_id)
        except LoRAAdapterError as exc:
            self.waiting.remove(req)
            req.finished = FinishReason("abort", message=str(exc), status_code=exc.status)
            self.failed.append(req)
            return False

    def _admit(self, req: Req, match: MatchResult) -> None:
        """Give a request its slot-table row and the cached prefix (already locked by the caller)."""
        req.req_pool_idx = self.req_pool.alloc()
        req.prefix_node = match.node
        req.prefix_len = req.kv_len = match.length
        if match.length:
            self.req_pool.write(req.req_pool_idx, 0, match.slots)
        if not req.admitted_once:
            req.cached_tokens = match.length
            req.admitted_once = True
            self.counters["cached_prompt_tokens"] += match.length

    def retract_for(self, needed: int, running: list[Req]) -> list[Req]:
        """Decode ran out of slots: send the requests with the least progress back to the waiting queue (their KV
        released, removed from `running`). Returns them."""
        victims = sorted(running, key=lambda r: (len(r.output_ids), -r.arrival))
        available = self.kv.available
        retracted = []
        while available() < needed and len(running) > 1 and victims:
            req = victims.pop(0)
            running.remove(req)
            self.kv.release(req)  # its tokens stay in the prefix cache, so resuming is cheap if not evicted
            req.num_retractions += 1
            self.counters["retractions"] += 1
            self.waiting.appendleft(req)
            retracted.append(req)
            logger.info("retracted %s after %d tokens (KV pool full)", req.rid, len(req.output_ids))
        return retracted
