"""One batch while the runner holds it: its request lines, those still to start, those running, those on disk."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any

from gramserve.server.batch.lines import LineRef, read_body
from gramserve.server.batch.results import ResultWriter
from gramserve.server.batch.store import BatchRecord

INLINE_READ_BYTES = 64 * 1024  # longer lines are read and parsed off the event loop


class BatchJob:
    def __init__(self, record: BatchRecord):
        self.id = record.id
        self.endpoint = record.endpoint
        self.record = record
        self.cancelling = record.status == "cancelling"
        self.failed = False  # it could not go on (its results could not be written): no line starts any more
        self.lines: list[LineRef] = []
        self.pending: deque[LineRef] = deque()  # not started yet, in file order
        self.running: dict[int, asyncio.Task] = {}  # line number -> its task
        self.recorded: set[str] = set()  # custom_ids whose result is on disk
        self.writer: ResultWriter | None = None
        self.settled = asyncio.Event()  # every line recorded, or (cancelling) nothing running any more
        self._input_fd: int | None = None

    def load(self, lines: list[LineRef], recorded: set[str], input_path: str | None) -> None:
        """The lines of the input file, and which of them are already on disk (after a restart)."""
        self.lines = lines
        self.recorded = set(recorded)
        self.pending = deque(ref for ref in lines if ref.custom_id not in self.recorded)
        if input_path is not None and self.pending:
            self._input_fd = os.open(input_path, os.O_RDONLY)
        self._check_settled()

    async def read_body(self, ref: LineRef) -> dict[str, Any]:
        if ref.length > INLINE_READ_BYTES:
            return await asyncio.to_thread(read_body, self._input_fd, ref)
        return read_body(self._input_fd, ref)

    def take(self) -> LineRef:
        return self.pending.popleft()

    def put_back(self, ref: LineRef) -> None:
        """A line that could not run now goes first in line again."""
        self.pending.appendleft(ref)

    def started(self, ref: LineRef, task: asyncio.Task) -> None:
        self.running[ref.number] = task

    def ended(self, ref: LineRef) -> None:
        self.running.pop(ref.number, None)
        self._check_settled()

    def on_recorded(self, custom_ids: list[str]) -> None:
        self.recorded.update(custom_ids)
        self._check_settled()

    def cancel(self) -> None:
        """No line starts any more; the running ones are aborted (their engine requests too)."""
        self.cancelling = True
        self.pending.clear()
        for task in self.running.values():
            task.cancel()
        self._check_settled()

    @property
    def has_pending(self) -> bool:
        return bool(self.pending) and not self.cancelling

    @property
    def all_recorded(self) -> bool:
        return len(self.recorded) >= len(self.lines)

    def close(self) -> None:
        if self._input_fd is not None:
            os.close(self._input_fd)
            self._input_fd = None
        if self.writer is not None:
            self.writer.close()

    def _check_settled(self) -> None:
        if self.all_recorded or (self.cancelling and not self.running):
            self.settled.set()
