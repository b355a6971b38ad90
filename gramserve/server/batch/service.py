"""The Batch API of one server: its store and its runner, made by `create_app`, started and stopped by the app's
lifespan. When the data folder cannot be used (not writable, or held by another server) the server still serves
everything else, and the Batch API's routes answer 503 saying why."""

from __future__ import annotations

import logging

from gramserve.config import ServerArgs, ServerConfig, Settings
from gramserve.server.batch.execute import LineExecutor
from gramserve.server.batch.runner import BatchRunner
from gramserve.server.batch.store import BatchStore, DataDirError, resolve_data_dir
from gramserve.server.errors import EngineUnavailableError
from gramserve.server.openai_serving import OpenAIServing
from gramserve.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


def in_flight_limit(args: ServerArgs, settings: Settings) -> int:
    """--batch-max-in-flight, by default a quarter of the running requests; never more than half of
    --max-queued-requests, so batch lines alone can never fill the waiting queue."""
    limit = args.batch_max_in_flight or max(1, settings.max_running_requests // 4)
    if args.max_queued_requests:
        cap = max(1, args.max_queued_requests // 2)
        if limit > cap and args.batch_max_in_flight:
            logger.warning(
                "--batch-max-in-flight %d is more than half of --max-queued-requests %d: using %d",
                limit,
                args.max_queued_requests,
                cap,
            )
        limit = min(limit, cap)
    return limit


class BatchService:
    def __init__(self, config: ServerConfig, tm: TokenizerManager, serving: OpenAIServing):
        args = config.args
        self.data_dir = resolve_data_dir(args.data_dir)
        self.max_in_flight = in_flight_limit(args, config.settings)
        self.store: BatchStore | None = None
        self.runner: BatchRunner | None = None
        self.unavailable: str | None = None  # why the Batch API is off
        try:
            self.store = BatchStore(self.data_dir)
            self.store.sweep()
        except DataDirError as exc:
            self.unavailable = str(exc)
            logger.warning("the Batch API is off: %s", exc)
            return
        executor = LineExecutor(serving, args)
        self.runner = BatchRunner(self.store, executor, tm.health, self.max_in_flight, args.batch_max_requests)
        logger.info(
            "Batch API: data in %s, files up to %d bytes, up to %d requests a batch, %d engine requests in flight",
            self.data_dir,
            args.max_file_bytes,
            args.batch_max_requests,
            self.max_in_flight,
        )

    def require_store(self) -> BatchStore:
        if self.store is None:
            raise EngineUnavailableError(f"the Batch API is off on this server: {self.unavailable}")
        return self.store

    def require_runner(self) -> BatchRunner:
        self.require_store()
        return self.runner

    def start(self) -> None:
        if self.runner is not None:
            self.runner.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            self.store.close()
            self.store = None
            self.unavailable = "the server is stopping"
