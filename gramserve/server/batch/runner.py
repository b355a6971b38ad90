"""The batch runner: one task on the server's event loop that takes batches through their statuses and runs their
lines.

validating -> in_progress -> finalizing -> completed, or validating -> failed (a malformed input file); a cancel
moves validating / in_progress to cancelling, then cancelled once the running lines are aborted. On start-up (after
the warm-up) the unfinished batches of the store resume where they stopped: their result files say which lines are
done.

Lines start while the server is healthy, at most `max_in_flight` engine requests at once over every batch, taking
one line from each batch with lines left in turn (round robin, batches in the order they were created or resumed).
A line the server could not run now (RetryLater: draining, stalled, queue full) goes back first in its batch's
queue and nothing starts for a second; while the server drains nothing starts at all, and what did not finish runs
again after the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections import deque

from gramserve.server.batch import models as M
from gramserve.server.batch.execute import LineExecutor, LineOutcome, RetryLater, engine_requests
from gramserve.server.batch.job import BatchJob
from gramserve.server.batch.lines import LineError, LineRef, scan_input
from gramserve.server.batch.results import Result, ResultWriter, read_back, usage_of
from gramserve.server.batch.store import ACTIVE_STATUSES, BatchRecord, BatchStore, FileRecord, now
from gramserve.server.health import ServerHealth
from gramserve.server.request_id import set_request_id

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the dispatcher looks again at the server's health while it waits
RETRY_PAUSE_S = 1.0  # after a line the server could not run, nothing starts for this long


def result_for(ref: LineRef, outcome: LineOutcome, request_id: str) -> Result:
    line = M.OutputLine(
        id=f"batch_req_{uuid.uuid4().hex}",
        custom_id=ref.custom_id,
        response=M.LineResponse(status_code=outcome.status_code, request_id=request_id, body=outcome.body),
    )
    ok = outcome.status_code == 200
    tokens = usage_of(outcome.body) if ok else (0, 0, 0)
    return Result(ref.custom_id, ok, line.model_dump_json().encode() + b"\n", *tokens)


def failure_for(ref: LineRef, code: str, message: str) -> Result:
    """A line that could not be run at all (no response): its `error` field says why."""
    line = M.OutputLine(
        id=f"batch_req_{uuid.uuid4().hex}", custom_id=ref.custom_id, error=M.LineFailure(code=code, message=message)
    )
    return Result(ref.custom_id, False, line.model_dump_json().encode() + b"\n")


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        executor: LineExecutor,
        health: ServerHealth | None,
        max_in_flight: int,
        max_requests: int,
    ):
        self.store = store
        self.executor = executor
        self.health = health
        self.max_in_flight = max_in_flight
        self.max_requests = max_requests
        self.jobs: dict[str, BatchJob] = {}
        self.in_flight = 0  # engine requests of the running lines
        self._rotation: deque[BatchJob] = deque()  # batches with lines to start, in turn
        self._wake = asyncio.Event()
        self._paused_until = 0.0
        self._resumed = False
        self._stopping = False
        self._main: asyncio.Task | None = None
        self._drivers: dict[str, asyncio.Task] = {}

    # --- called by the API and the app -----------------------------------------------------------

    def start(self) -> None:
        self._main = asyncio.create_task(self._run(), name="batch-runner")
        self._main.add_done_callback(_log_end)

    def submit(self, batch_id: str) -> None:
        """A batch was just created. (Before the runner has resumed, the resume picks it up.)"""
        if self._resumed and not self._stopping:
            record = self.store.get_batch(batch_id)
            if record is not None:
                self._adopt(record)

    def cancel(self, batch_id: str) -> bool:
        """Move a validating or running batch to cancelling; whether it was one."""
        if not self.store.move_batch(batch_id, "cancelling", ("validating", "in_progress")):
            return False
        job = self.jobs.get(batch_id)
        if job is not None:
            job.cancel()
            self._wake.set()
        return True

    async def stop(self) -> None:
        """The server is stopping: nothing more starts, running lines are aborted (they run again after the
        restart), and every result already handed over reaches the disk."""
        self._stopping = True
        tasks = [t for t in (self._main, *self._drivers.values()) if t is not None]
        tasks += [t for job in self.jobs.values() for t in job.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in self.jobs.values():
            if job.writer is not None:
                await job.writer.drain()
            job.close()

    # --- the main loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while self.health is not None and self.health.warming:
            await asyncio.sleep(POLL_S)
        records = self.store.active_batches()
        self._resumed = True
        if records:
            logger.info("batch runner: resuming %d unfinished batches", len(records))
        for record in records:
            self._adopt(record)
        await self._dispatch()

    def _adopt(self, record: BatchRecord) -> None:
        if record.id in self.jobs:
            return
        job = BatchJob(record)
        self.jobs[record.id] = job
        self._drivers[record.id] = asyncio.create_task(self._drive(job), name=f"batch-{record.id}")

    async def _dispatch(self) -> None:
        while True:
            job = await self._next_job()
            ref = job.take()
            if job.has_pending:
                self._rotation.append(job)
            try:
                body = await job.read_body(ref)
            except Exception as exc:  # noqa: BLE001 - the input changed on disk since it was validated
                logger.error("batch %s: cannot read line %d again: %s", job.id, ref.number, exc)
                if not job.cancelling:
                    self._start_line(job, ref, failure_for(ref, "invalid_line", f"the line cannot be read: {exc}"), 1)
                continue
            cost = min(engine_requests(job.endpoint, body), self.max_in_flight)
            await self._wait_for_room(cost)
            if job.cancelling:
                continue
            self._start_line(job, ref, body, cost)

    async def _next_job(self) -> BatchJob:
        """The next batch in turn with a line to start, once the server can take one more."""
        while True:
            while self._rotation and not self._rotation[0].has_pending:
                self._rotation.popleft()
            if self._rotation and self.in_flight < self.max_in_flight and self._may_start():
                return self._rotation.popleft()
            await self._sleep()

    async def _wait_for_room(self, cost: int) -> None:
        while self.in_flight + cost > self.max_in_flight or not self._may_start():
            await self._sleep()

    def _may_start(self) -> bool:
        if self._stopping or asyncio.get_running_loop().time() < self._paused_until:
            return False
        return self.health is None or self.health.problem() is None

    async def _sleep(self) -> None:
        """Until something changes (a line ends, a batch arrives), or POLL_S (health is not an event)."""
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), POLL_S)

    def _schedule(self, job: BatchJob) -> None:
        if job.has_pending and job not in self._rotation:
            self._rotation.append(job)
            self._wake.set()

    # --- one line ----------------------------------------------------------------------------------

    def _start_line(self, job: BatchJob, ref: LineRef, work: dict | Result, cost: int) -> None:
        self.in_flight += cost
        task = asyncio.create_task(self._run_line(job, ref, work, cost), name=f"batch-line-{job.id}-{ref.number}")
        job.started(ref, task)

    async def _run_line(self, job: BatchJob, ref: LineRef, work: dict | Result, cost: int) -> None:
        try:
            if isinstance(work, Result):
                result = work
            else:
                request_id = uuid.uuid4().hex
                set_request_id(request_id)  # this task's context: the response id and engine rids carry it
                result = result_for(ref, await self.executor.run(job.endpoint, work, ref.length), request_id)
            await job.writer.write(result)
        except RetryLater as exc:
            logger.info("batch %s: line %d could not run now (%s); it will run again", job.id, ref.number, exc)
            job.put_back(ref)
            self._schedule(job)
            self._paused_until = asyncio.get_running_loop().time() + RETRY_PAUSE_S
        except asyncio.CancelledError:
            raise  # a cancelled batch, or the server stopping: not a result
        except Exception as exc:  # noqa: BLE001 - the results could not be written: the batch cannot go on
            logger.exception("batch %s: cannot write the result of line %d", job.id, ref.number)
            self._fail(job, "storage_error", f"the results could not be written: {exc}")
        finally:
            self.in_flight -= cost
            job.ended(ref)
            self._wake.set()

    # --- one batch, from start to end ----------------------------------------------------------------

    async def _drive(self, job: BatchJob) -> None:
        try:
            if job.record.status == "validating" and not await self._validate(job):
                return
            await self._load(job)
            if job.record.status == "in_progress" and not job.cancelling:
                self._schedule(job)
                await job.settled.wait()
            await job.writer.drain()
            if job.failed and not self._stopping:
                self._publish_partial(job)
            if self._stopping or job.failed:
                return
            self._finish(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a batch that cannot go on fails; the others keep running
            logger.exception("batch %s failed", job.id)
            self._fail(job, "internal_error", f"the batch could not be run: {type(exc).__name__}: {exc}")
            if job.writer is not None:
                with contextlib.suppress(Exception):
                    await job.writer.drain()
                self._publish_partial(job)
        finally:
            if not self._stopping:
                self._forget(job)

    async def _validate(self, job: BatchJob) -> bool:
        """Check the input file; whether the batch goes on (to in_progress, or to cancelled)."""
        record = job.record
        path = self.store.file_path(record.input_file_id)
        try:
            scanned = await asyncio.to_thread(scan_input, path, record.endpoint, self.max_requests)
        except FileNotFoundError:
            scanned = None
        if job.cancelling:
            job.lines = scanned.lines if scanned is not None else []
            return True
        if scanned is None:
            errors = [LineError("file_not_found", f"The input file {record.input_file_id} no longer exists.")]
        else:
            errors = scanned.errors
        if errors:
            count = scanned.error_count if scanned is not None else len(errors)
            logger.info("batch %s failed validation: %d errors, the first: %s", job.id, count, errors[0].message)
            self.store.move_batch(job.id, "failed", ("validating",), errors=[e.to_dict() for e in errors])
            return False
        if not self.store.move_batch(job.id, "in_progress", ("validating",), total=len(scanned.lines)):
            return True  # cancelled meanwhile (job.cancelling is set)
        job.lines = scanned.lines
        job.record = self.store.get_batch(job.id)
        logger.info("batch %s: %d requests, in progress", job.id, len(scanned.lines))
        return True

    async def _load(self, job: BatchJob) -> None:
        """The batch's lines and, after a restart, the results already on disk; opens its result files."""
        record = job.record
        out_path = self.store.file_path(record.work_output_id)
        err_path = self.store.file_path(record.work_error_id)
        tally = await asyncio.to_thread(read_back, out_path, err_path)
        lines = job.lines
        if record.status == "in_progress" and not lines:  # resumed: read the input again
            path = self.store.file_path(record.input_file_id)
            lines = (await asyncio.to_thread(scan_input, path, record.endpoint, self.max_requests)).lines
        if tally.custom_ids:
            logger.info("batch %s: %d results already on disk", job.id, len(tally.custom_ids))
        self.store.update_batch(job.id, **tally.counts())
        job.load(lines, tally.custom_ids, self.store.file_path(record.input_file_id))
        job.writer = ResultWriter(
            out_path,
            err_path,
            tally,
            on_written=lambda t: self.store.update_batch(job.id, **t.counts()),
            on_recorded=job.on_recorded,
        )

    def _finish(self, job: BatchJob) -> None:
        """Publish the result files (those with lines) and take the final status."""
        status = "cancelled" if job.cancelling else "completed"
        if status == "completed":
            self.store.move_batch(job.id, "finalizing", ("in_progress",))
        self._publish(job, status)

    def _publish_partial(self, job: BatchJob) -> None:
        """A failed batch keeps the results it had finished: its result files are published as they stand."""
        if job.writer is None:
            return
        try:
            self._publish(job, "failed")
        except Exception:  # noqa: BLE001 - the batch stays failed; its work files are swept at the next start
            logger.exception("batch %s: the results of a failed batch could not be published", job.id)

    def _publish(self, job: BatchJob, status: str) -> None:
        record, tally = job.record, job.writer.tally
        outputs = []
        published = {}
        for work_id, kind, lines in (
            (record.work_output_id, "output", tally.completed),
            (record.work_error_id, "error", tally.failed),
        ):
            path = self.store.file_path(work_id)
            size = os.path.getsize(path) if os.path.exists(path) else 0
            if size:
                outputs.append(FileRecord(work_id, f"{job.id}_{kind}.jsonl", "batch_output", size, lines, now()))
                published[f"{kind}_file_id"] = work_id
        self.store.finish_batch(job.id, status, outputs, **published, **tally.counts())
        job.close()
        for work_id in (record.work_output_id, record.work_error_id):
            if work_id not in published.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.store.file_path(work_id))
        logger.info("batch %s %s: %d completed, %d failed", job.id, status, tally.completed, tally.failed)

    def _fail(self, job: BatchJob, code: str, message: str) -> None:
        job.failed = True
        job.cancel()
        error = LineError(code, message).to_dict()
        self.store.move_batch(job.id, "failed", ACTIVE_STATUSES, errors=[error])

    def _forget(self, job: BatchJob) -> None:
        job.cancel()
        job.close()
        self.jobs.pop(job.id, None)
        self._drivers.pop(job.id, None)
        with contextlib.suppress(ValueError):
            self._rotation.remove(job)


def _log_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the batch runner stopped: no batch line starts any more", exc_info=task.exception())
