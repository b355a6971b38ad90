"""The scheduler's LoRA adapters: which are registered, which are in host memory, which sit in device pool slots.

- Registered: every adapter the main process has named (id -> folder). Ids are never reused, so a prefix-cache
  namespace (the adapter id) never outlives its adapter's weights.
- Host memory: up to --max-loaded-loras adapters' weights; past it the least recently used one is dropped and read
  from its folder again when a request needs it.
- Device pool: --max-loras-per-batch slots. A request is admitted only while the adapters of the running requests
  plus its own fit in the slots; its adapter then takes a slot (free, or the least recently used one that no running
  request holds).

Reading an adapter's files (a load at run time, or one dropped from host memory) happens on a reader thread, never
in the scheduler's loop: the running batch goes on meanwhile, and a request whose adapter is being read waits.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

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
        self.counters = {"lora_loads": 0, "lora_slot_loads": 0, "lora_rereads": 0}
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-reader")
        self._rereads: dict[int, Future] = {}  # id -> its files being read again
        self._registering: list[tuple[object, int, str, Future]] = []  # (tag, id, folder, read) of run-time loads

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def _read(self, path: str) -> LoRAAdapter:
        cfg = self.runner.cfg
        return load_adapter(path, self.runner.config, cfg.max_lora_rank, cfg.lora_target_modules, self.runner.dtype)

    def register(self, lora_id: int, path: str) -> LoRAAdapter:
        """Read, check and keep an adapter now (at start; raises LoRAAdapterError)."""
        adapter = self._read(path)
        self._registered(lora_id, path, adapter)
        return adapter

    def register_later(self, tag: object, lora_id: int, path: str) -> None:
        """Read and check an adapter on the reader thread; finished_registrations() reports it under `tag`."""
        self._registering.append((tag, lora_id, path, self._reader.submit(self._read, path)))

    def finished_registrations(self) -> list[tuple[object, LoRAAdapter | LoRAAdapterError]]:
        """The run-time loads whose read is over: (tag, the adapter, now registered, or why it was refused)."""
        done, self._registering = (
            [r for r in self._registering if r[3].done()],
            [r for r in self._registering if not r[3].done()],
        )
        results = []
        for tag, lora_id, path, read in done:
            try:
                adapter = read.result()
            except LoRAAdapterError as exc:
                results.append((tag, exc))
                continue
            except Exception as exc:  # noqa: BLE001 - an unreadable file is the request's error, not the server's
                results.append((tag, LoRAAdapterError(f"could not read the adapter at {path}: {exc}")))
                continue
            self._registered(lora_id, path, adapter)
            results.append((tag, adapter))
        return results

    @property
    def reading(self) -> bool:
        return bool(self._registering or self._rereads)

    def _registered(self, lora_id: int, path: str, adapter: LoRAAdapter) -> None:
        self.paths[lora_id] = path
        self._keep(lora_id, adapter)
        self.counters["lora_loads"] += 1

    def unregister(self, lora_id: int) -> None:
        """Forget an adapter. The main process sends this only once none of its requests is left."""
        self.paths.pop(lora_id, None)
        self.host.pop(lora_id, None)
        self._rereads.pop(lora_id, None)
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

    def ready(self, lora_id: int) -> bool:
        """The adapter's weights are in a slot or in host memory. If not, its files are read again on the reader
        thread (False until then); raises LoRAAdapterError when it is no longer registered or the read failed."""
        if lora_id in self.slot_of or lora_id in self.host:
            return True
        path = self.paths.get(lora_id)
        if path is None:
            raise LoRAAdapterError(f"LoRA adapter {lora_id} is not loaded", status=404)
        read = self._rereads.get(lora_id)
        if read is None:
            self._rereads[lora_id] = self._reader.submit(self._read, path)
            return False
        if not read.done():
            return False
        del self._rereads[lora_id]
        try:
            adapter = read.result()
        except LoRAAdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the folder went away since it was loaded
            raise LoRAAdapterError(f"could not read the adapter at {path} again: {exc}") from exc
        self._keep(lora_id, adapter)
        self.counters["lora_rereads"] += 1
        return True

    def fits(self, lora_id: int, active: set[int]) -> bool:
        """A request of this adapter can join a batch whose adapters are `active` (ids, 0 not included)."""
        return lora_id in active or len(active) < self.num_slots

    def acquire(self, lora_id: int, active: set[int]) -> int:
        """The device slot of an adapter that is ready(), copying it into the pool if needed (evicting the least
        recently used slot no request of `active` holds)."""
        self._tick += 1
        slot = self.slot_of.get(lora_id)
        if slot is None:
            adapter = self.host[lora_id]
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
