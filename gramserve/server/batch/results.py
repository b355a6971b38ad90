"""A batch's results on disk: appending them durably to its output and error files, and reading them back after a
restart.

A result counts as done only once its line is on disk: lines are appended in groups (whatever finished meanwhile),
each group written, flushed and fsync'd before its lines count and the batch's counts move on in the store. After a
restart the output and error files are the truth: their custom_ids are the lines not to run again, their counts and
token usage the batch's; a line cut short by a crash (no newline, or not JSON) is cut off the file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from gramserve.server.batch.store import fsync_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """One line's outcome, ready to append: to the output file when `ok` (status 200), else to the error file."""

    custom_id: str
    ok: bool
    line: bytes  # the JSON line, newline included
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


@dataclass
class Tally:
    """What a batch's result files hold."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    custom_ids: set[str] = field(default_factory=set)

    def add(self, result: Result) -> None:
        if result.ok:
            self.completed += 1
        else:
            self.failed += 1
        self.input_tokens += result.input_tokens
        self.cached_tokens += result.cached_tokens
        self.output_tokens += result.output_tokens
        self.custom_ids.add(result.custom_id)

    def counts(self) -> dict[str, int]:
        """The store's batch columns these numbers fill."""
        return {
            "completed": self.completed,
            "failed": self.failed,
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
        }


def usage_of(body: dict) -> tuple[int, int, int]:
    """(prompt, cached prompt, completion) tokens of a chat or completions response body."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), usage.get("completion_tokens", 0)


def result_from_line(line: bytes, ok: bool) -> Result:
    """A result read back from a result file (raises ValueError if the line is not one)."""
    obj = json.loads(line)
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    if not isinstance(custom_id, str):
        raise ValueError("no custom_id")
    tokens = usage_of((obj.get("response") or {}).get("body") or {}) if ok else (0, 0, 0)
    return Result(custom_id, ok, line, *tokens)


def _read_back(path: str, ok: bool, tally: Tally) -> None:
    """Add a result file's lines to `tally`, cutting off a last line a crash left incomplete."""
    if not os.path.exists(path):
        return
    good_end = 0
    with open(path, "rb+") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                tally.add(result_from_line(line, ok))
            except ValueError:
                break
            good_end += len(line)
        size = f.seek(0, os.SEEK_END)
        if good_end < size:
            logger.warning("%s: cutting off %d bytes of an incomplete last result", path, size - good_end)
            f.truncate(good_end)
            os.fsync(f.fileno())


def read_back(output_path: str, error_path: str) -> Tally:
    """The results a batch has on disk (after a restart)."""
    tally = Tally()
    _read_back(output_path, True, tally)
    _read_back(error_path, False, tally)
    return tally


class ResultWriter:
    """Appends a batch's results durably, a group at a time, off the event loop.

    `write` returns once the result is on disk. `on_written` (called in the writing thread, after each group's
    fsync) gets the tally so far, to store the counts; `on_recorded` (on the event loop) the custom_ids of the group.
    """

    def __init__(
        self,
        output_path: str,
        error_path: str,
        tally: Tally,
        on_written: Callable[[Tally], None],
        on_recorded: Callable[[list[str]], None],
    ):
        self.tally = tally
        self._files = {True: open(output_path, "ab"), False: open(error_path, "ab")}
        fsync_dir(os.path.dirname(output_path))  # the files' names survive a crash too
        self._on_written = on_written
        self._on_recorded = on_recorded
        self._pending: list[tuple[Result, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def write(self, result: Result) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((result, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_pending())
        await fut

    async def drain(self) -> None:
        """Wait until every result handed over is on disk (or failed)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    async def _flush_pending(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._append, [result for result, _ in group])
            except Exception as exc:  # noqa: BLE001 - each writer hears of it
                for _, fut in group:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self._on_recorded([result.custom_id for result, _ in group])
            for _, fut in group:
                if not fut.done():
                    fut.set_result(None)

    def _append(self, results: list[Result]) -> None:
        touched = set()
        for result in results:
            self._files[result.ok].write(result.line)
            touched.add(result.ok)
        for ok in touched:
            f = self._files[ok]
            f.flush()
            os.fsync(f.fileno())
        for result in results:
            self.tally.add(result)
        self._on_written(self.tally)
