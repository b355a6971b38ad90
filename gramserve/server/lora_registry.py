"""The main process's LoRA adapters: names -> ids, the requests each has in flight, loading and unloading.

A request names an adapter by `model` (OpenAI clients) or `lora_path` (SGLang's field). `acquire` gives the id the
scheduler knows the adapter by and counts the request; `release` uncounts it. An unload first stops new requests
(404), waits for those in flight, then tells the scheduler, which frees the adapter's memory. Ids are never reused:
they are also the adapters' prefix-cache namespaces.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from gramserve.config import ServerConfig, check_lora_name
from gramserve.model.lora.adapter import LoRAAdapterError, read_adapter_config
from gramserve.server.errors import InvalidRequestError, ModelNotServedError

logger = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 600.0  # the scheduler reads and checks the weights


class LoRANotFoundError(ModelNotServedError):
    pass


@dataclass
class Adapter:
    name: str
    lora_id: int
    path: str  # its PEFT folder (/v1/models gives it as `root`, as vLLM does)
    refs: int = 0  # requests in flight
    unloading: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class LoRARegistry:
    def __init__(self, config: ServerConfig, control: Callable[..., Awaitable[dict]]):
        self.enabled = config.args.lora_enabled
        self.base_name = config.args.model_name
        self._control = control  # TokenizerManager.control: a query to the scheduler
        self.adapters: dict[str, Adapter] = {}
        for lora_id, (name, path) in enumerate(config.settings.lora_modules, start=1):  # the scheduler's ids
            self.adapters[name] = Adapter(name, lora_id, str(path))
        self._next_id = len(self.adapters) + 1
        self._lock = asyncio.Lock()  # one load or unload at a time

    @property
    def served(self) -> list[Adapter]:
        return [a for a in self.adapters.values() if not a.unloading]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.served]

    def adapter_for(self, model: str | None, lora_path: str | None = None) -> str | None:
        """The adapter a request names (None: the base model); 404 for a name this server does not serve."""
        if lora_path is not None:
            self._live(lora_path, "lora_path")
            return lora_path
        if model is None or model in (self.base_name, "default"):
            return None
        if model in self.adapters:
            self._live(model, "model")
            return model
        served = ", ".join([self.base_name, *self.names])
        raise ModelNotServedError(f"The model `{model}` does not exist. This server serves: {served}.")

    def _live(self, name: str, param: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None or adapter.unloading:
            state = "is being unloaded" if adapter is not None else "is not loaded"
            raise LoRANotFoundError(f"LoRA adapter `{name}` {state} ({param}); loaded: {self.names or 'none'}")
        return adapter

    def acquire(self, name: str | None) -> int:
        """Count a request of this adapter in flight; returns its id (0 for the base model)."""
        if name is None:
            return 0
        adapter = self._live(name, "model")
        adapter.refs += 1
        adapter.idle.clear()
        return adapter.lora_id

    def release(self, name: str | None) -> None:
        if name is None:
            return
        adapter = self.adapters.get(name)
        if adapter is not None:
            adapter.refs -= 1
            if adapter.refs == 0:
                adapter.idle.set()

    async def load(self, name: str, path: str) -> dict:
        """Load an adapter: its folder checked here, its weights read and checked by the scheduler."""
        if not self.enabled:
            raise InvalidRequestError("LoRA is off on this server: start it with --enable-lora", "lora_name")
        try:
            check_lora_name(name)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "lora_name") from None
        if name in (self.base_name, "default"):
            raise InvalidRequestError(f"`{name}` is the base model's name", "lora_name")
        try:
            read_adapter_config(path)
        except LoRAAdapterError as exc:
            raise InvalidRequestError(str(exc), "lora_path") from None
        async with self._lock:
            if name in self.adapters:
                raise InvalidRequestError(f"a LoRA adapter named `{name}` is already loaded", "lora_name")
            lora_id, self._next_id = self._next_id, self._next_id + 1
            result = await self._control("load_lora", {"lora_id": lora_id, "path": path}, timeout=LOAD_TIMEOUT_S)
            if not result.get("ok"):
                raise InvalidRequestError(result.get("error", "the adapter could not be loaded"), "lora_path")
            self.adapters[name] = Adapter(name, lora_id, path)
        logger.info("LoRA adapter %s loaded (id %d, rank %s)", name, lora_id, result.get("rank"))
        return result

    async def unload(self, name: str) -> None:
        if not self.enabled:
            raise InvalidRequestError("LoRA is off on this server: start it with --enable-lora", "lora_name")
        async with self._lock:
            adapter = self._live(name, "lora_name")
            adapter.unloading = True
            try:
                if adapter.refs:
                    logger.info("unloading LoRA adapter %s: waiting for %d requests", name, adapter.refs)
                    await adapter.idle.wait()
                await self._control("unload_lora", {"lora_id": adapter.lora_id})
            except BaseException:
                adapter.unloading = False  # the client left (or the scheduler did not answer): still served
                raise
            del self.adapters[name]
        logger.info("LoRA adapter %s unloaded", name)
