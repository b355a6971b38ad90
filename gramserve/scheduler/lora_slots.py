"""The scheduler's LoRA adapters: which are registered, which are in host memory, which sit in device pool slots.

- Registered: every adapter the main process has named (id -> folder). Ids are never reused, so a prefix-cache
  namespace (the adapter id) never outlives its adapter's weights.
- Host memory: up to --max-loaded-loras adapters' weights; past it the least recently used one is dropped and read
  from its folder again when a request needs it.
- Device pool: --max-loras-per-batch slots. A request is admitted only while the adapters of the running requests
  plus its own fit in the slots; its adapter then takes a slot (free, or the least recently used one that no running
  request holds).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from gramserve.model.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from gramserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, runner: ModelRunner, max_loaded: int):
        self.runner = runner
        self.pool = runner.lora_pool
        assert self.pool is not None
        self.max_loaded = max_loaded
        self.paths: dict[int, str] = {}  # registered adapters: id -> folder
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_owner: list[int | None] = [None] * self.pool.num_slots
        self.slot_of: dict[int, int] = {}
        self._tick = 0
        self._last_use = [0] * self.pool.num_slots
        self.counters = {"lora_loads": 0, "lora_slot_loads": 0}

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def _read(self, path: str) -> LoRAAdapter:
        cfg = self.runner.cfg
        return load_adapter(path, self.runner.config, cfg.max_lora_rank, cfg.lora_target_modules, self.runner.dtype)

    def register(self, lora_id: int, path: str) -> LoRAAdapter:
        """Read, check and keep an adapter (raises LoRAAdapterError)."""
        adapter = self._read(path)
        self.paths[lora_id] = path
        self._keep(lora_id, adapter)
        self.counters["lora_loads"] += 1
        return adapter

    def unregister(self, lora_id: int) -> None:
        """Forget an adapter. The main process sends this only once none of its requests is left."""
        self.paths.pop(lora_id, None)
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slot_owner[slot] = None
            self.pool.clear(slot)

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.max_loaded:
            dropped, _ = self.host.popitem(last=False)
            logger.info("LoRA adapter %d leaves host memory (--max-loaded-loras %d)", dropped, self.max_loaded)

    def fits(self, lora_id: int, active: set[int]) -> bool:
        """A request of this adapter can join a batch whose adapters are `active` (ids, 0 not included)."""
        return lora_id in active or len(active) < self.num_slots

    def acquire(self, lora_id: int, active: set[int]) -> int:
        """The device slot of an adapter, loading it into the pool if needed (evicting the least recently used slot
        no request of `active` holds). Raises LoRAAdapterError when it is no longer registered or readable."""
        self._tick += 1
        slot = self.slot_of.get(lora_id)
        if slot is None:
            if lora_id not in self.paths:
                raise LoRAAdapterError(f"LoRA adapter {lora_id} is not loaded", status=404)
            adapter = self.host.get(lora_id)
            if adapter is None:  # dropped from host memory: read it again
                adapter = self._read(self.paths[lora_id])
                self._keep(lora_id, adapter)
            free = [s for s, owner in enumerate(self.slot_owner) if owner is None or owner not in active]
            slot = min(free, key=lambda s: (self.slot_owner[s] is not None, self._last_use[s]))
            previous = self.slot_owner[slot]
            if previous is not None:
                del self.slot_of[previous]
            self.pool.load(slot, adapter)
            self.slot_owner[slot], self.slot_of[lora_id] = lora_id, slot
            self.counters["lora_slot_loads"] += 1
        elif lora_id in self.host:
            self.host.move_to_end(lora_id)
        self._last_use[slot] = self._tick
        return slot

    def report(self) -> dict:
        return {
            "registered": len(self.paths),
            "in_host_memory": len(self.host),
            "slots": self.num_slots,
            "slots_used": sum(owner is not None for owner in self.slot_owner),
            "pool_mib": round(self.pool.nbytes / 2**20, 1),
            **self.counters,
        }
