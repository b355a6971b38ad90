"""The Batch API's storage: file and batch records in SQLite (`<data-dir>/gramserve.sqlite`), file contents under
`<data-dir>/files/<file id>`.

One server owns a data folder at a time (an exclusive lock on `<data-dir>/gramserve.lock`, released when the
process ends), so two servers never run the same batch. Every method is safe from any thread (one connection behind
a lock): the result writers update counts from their own threads. Commits are synchronous (WAL, synchronous=FULL):
a record the API returned survives a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from gramserve.server.batch import models as M

DB_NAME = "gramserve.sqlite"
LOCK_NAME = "gramserve.lock"
SCHEMA_VERSION = 1
_SAFE_ID = re.compile(r"[A-Za-z0-9_\-]{1,128}")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    lines INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    model TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    work_output_id TEXT NOT NULL,
    work_error_id TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
"""

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
TIMESTAMP_OF = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


class DataDirError(RuntimeError):
    """The data folder cannot be used (not writable, or another server holds it)."""


class UnknownCursorError(LookupError):
    """A list's `after` names no object of that list."""


def resolve_data_dir(configured: str | None) -> str:
    """--data-dir, else $GRAMSERVE_DATA_DIR, else $XDG_DATA_HOME/gramserve (~/.local/share/gramserve)."""
    chosen = configured or os.environ.get("GRAMSERVE_DATA_DIR")
    if not chosen:
        base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        chosen = os.path.join(base, "gramserve")
    return os.path.abspath(os.path.expanduser(chosen))


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class FileRecord:
    id: str
    filename: str
    purpose: str  # batch (uploaded) | batch_output (a batch's output or error file)
    bytes: int
    lines: int  # non-blank lines: the requests of an input file
    created_at: int

    def to_api(self) -> M.FileObject:
        return M.FileObject(
            id=self.id, bytes=self.bytes, created_at=self.created_at, filename=self.filename, purpose=self.purpose
        )


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    work_output_id: str  # where the results go while the batch runs; published as output_file_id at the end
    work_error_id: str
    metadata: dict[str, str] | None = None
    model: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # validation errors (BatchError fields)

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    def to_api(self) -> M.Batch:
        usage = None
        if self.input_tokens or self.output_tokens:
            usage = M.BatchUsage(
                input_tokens=self.input_tokens,
                input_tokens_details=M.InputTokensDetails(cached_tokens=self.cached_tokens),
                output_tokens=self.output_tokens,
                total_tokens=self.input_tokens + self.output_tokens,
            )
        errors = M.BatchErrors(data=[M.BatchError(**e) for e in self.errors]) if self.errors else None
        return M.Batch(
            id=self.id,
            endpoint=self.endpoint,
            errors=errors,
            input_file_id=self.input_file_id,
            completion_window=self.completion_window,
            status=self.status,
            output_file_id=self.output_file_id,
            error_file_id=self.error_file_id,
            created_at=self.created_at,
            in_progress_at=self.in_progress_at,
            finalizing_at=self.finalizing_at,
            completed_at=self.completed_at,
            failed_at=self.failed_at,
            cancelling_at=self.cancelling_at,
            cancelled_at=self.cancelled_at,
            request_counts=M.BatchRequestCounts(total=self.total, completed=self.completed, failed=self.failed),
            metadata=self.metadata,
            model=self.model,
            usage=usage,
        )


_JSON_COLUMNS = ("metadata", "errors")
_BATCH_COLUMNS = tuple(f.name for f in dataclasses.fields(BatchRecord))
_FILE_COLUMNS = tuple(f.name for f in dataclasses.fields(FileRecord))


def _batch_from_row(row: sqlite3.Row) -> BatchRecord:
    values = {name: row[name] for name in _BATCH_COLUMNS}
    for name in _JSON_COLUMNS:
        if values[name] is not None:
            values[name] = json.loads(values[name])
    return BatchRecord(**values)


def _to_column(name: str, value: Any) -> Any:
    return json.dumps(value) if name in _JSON_COLUMNS and value is not None else value


class BatchStore:
    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.files_dir = os.path.join(data_dir, "files")
        try:
            os.makedirs(self.files_dir, exist_ok=True)
            self._lock_fd = _lock_folder(os.path.join(data_dir, LOCK_NAME))
        except OSError as exc:
            raise DataDirError(f"cannot use the data folder {data_dir}: {exc}") from exc
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(os.path.join(data_dir, DB_NAME), check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            self._create_schema()
        except (sqlite3.Error, DataDirError) as exc:
            os.close(self._lock_fd)
            raise DataDirError(f"cannot use {os.path.join(data_dir, DB_NAME)}: {exc}") from exc

    def _create_schema(self) -> None:
        with self._lock, self._conn:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise DataDirError(f"it was written by a newer gramserve (schema {version})")
            self._conn.executescript(SCHEMA)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
        os.close(self._lock_fd)  # releases the folder lock

    # --- paths -----------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> str:
        if not _SAFE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return os.path.join(self.files_dir, file_id)

    def upload_path(self, file_id: str) -> str:
        """Where an upload is written until it is whole (renamed to file_path then)."""
        return self.file_path(file_id) + ".partial"

    def sweep(self) -> int:
        """Remove contents no record or active batch refers to: uploads cut short, the empty result files of a
        batch whose end was interrupted. Returns how many were removed."""
        with self._lock:
            keep = {row[0] for row in self._conn.execute("SELECT id FROM files")}
            for row in self._conn.execute(
                f"SELECT work_output_id, work_error_id FROM batches WHERE status IN ({_marks(ACTIVE_STATUSES)})",
                ACTIVE_STATUSES,
            ):
                keep.update(row)
        removed = 0
        for name in os.listdir(self.files_dir):
            if name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.files_dir, name))
                    removed += 1
        return removed

    # --- files -----------------------------------------------------------------------------------

    def add_file(self, rec: FileRecord) -> None:
        with self._lock, self._conn:
            self._insert("files", dataclasses.asdict(rec))

    def get_file(self, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._conn.execute(
                f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE id = ?", (file_id,)
            ).fetchone()
        return FileRecord(**dict(row)) if row is not None else None

    def list_files(
        self, limit: int, after: str | None = None, order: str = "desc", purpose: str | None = None
    ) -> tuple[list[FileRecord], bool]:
        where, params = ("purpose = ?", [purpose]) if purpose else ("1", [])
        rows, more = self._page("files", _FILE_COLUMNS, where, params, limit, after, descending=order == "desc")
        return [FileRecord(**dict(r)) for r in rows], more

    def delete_file(self, file_id: str) -> bool:
        with self._lock, self._conn:
            return self._conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def active_batch_reading(self, file_id: str) -> str | None:
        """The id of an unfinished batch whose input is this file, if any."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({_marks(ACTIVE_STATUSES)}) LIMIT 1",
                (file_id, *ACTIVE_STATUSES),
            ).fetchone()
        return row[0] if row is not None else None

    # --- batches ---------------------------------------------------------------------------------

    def add_batch(self, rec: BatchRecord) -> None:
        with self._lock, self._conn:
            self._insert("batches", {k: _to_column(k, v) for k, v in dataclasses.asdict(rec).items()})

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self._conn.execute(
                f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        return _batch_from_row(row) if row is not None else None

    def list_batches(self, limit: int, after: str | None = None) -> tuple[list[BatchRecord], bool]:
        rows, more = self._page("batches", _BATCH_COLUMNS, "1", [], limit, after, descending=True)
        return [_batch_from_row(r) for r in rows], more

    def active_batches(self) -> list[BatchRecord]:
        """Unfinished batches, oldest first."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE status IN ({_marks(ACTIVE_STATUSES)}) "
                "ORDER BY seq",
                ACTIVE_STATUSES,
            ).fetchall()
        return [_batch_from_row(r) for r in rows]

    def update_batch(self, batch_id: str, **fields: Any) -> None:
        with self._lock, self._conn:
            self._update(batch_id, fields)

    def move_batch(self, batch_id: str, status: str, from_statuses: Iterable[str], **fields: Any) -> bool:
        """Set `status` (and its timestamp) only if the batch is in one of `from_statuses`; whether it was."""
        fields = {"status": status, TIMESTAMP_OF[status]: now(), **fields}
        allowed = tuple(from_statuses)
        with self._lock, self._conn:
            return self._update(batch_id, fields, allowed) > 0

    def finish_batch(self, batch_id: str, status: str, outputs: list[FileRecord], **fields: Any) -> None:
        """The batch's last step, in one transaction: its non-empty result files become files, and it takes its
        final status."""
        fields = {"status": status, TIMESTAMP_OF[status]: now(), **fields}
        with self._lock, self._conn:
            for rec in outputs:
                self._insert("files", dataclasses.asdict(rec), or_ignore=True)
            self._update(batch_id, fields)

    # --- helpers (the lock held) -------------------------------------------------------------------

    def _insert(self, table: str, values: dict[str, Any], or_ignore: bool = False) -> None:
        verb = "INSERT OR IGNORE" if or_ignore else "INSERT"
        names = ", ".join(values)
        self._conn.execute(f"{verb} INTO {table} ({names}) VALUES ({_marks(values)})", tuple(values.values()))

    def _update(self, batch_id: str, fields: dict[str, Any], from_statuses: tuple[str, ...] = ()) -> int:
        unknown = set(fields) - set(_BATCH_COLUMNS)
        if unknown:
            raise ValueError(f"no batch columns {sorted(unknown)}")
        sets = ", ".join(f"{name} = ?" for name in fields)
        params = [_to_column(k, v) for k, v in fields.items()] + [batch_id]
        sql = f"UPDATE batches SET {sets} WHERE id = ?"
        if from_statuses:
            sql += f" AND status IN ({_marks(from_statuses)})"
            params += list(from_statuses)
        return self._conn.execute(sql, params).rowcount

    def _page(
        self,
        table: str,
        columns: tuple[str, ...],
        where: str,
        params: list[Any],
        limit: int,
        after: str | None,
        descending: bool,
    ) -> tuple[list[sqlite3.Row], bool]:
        """One page of a list, newest first (or oldest first), starting after the object `after`; and whether more
        follow."""
        with self._lock:
            if after is not None:
                row = self._conn.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise UnknownCursorError(after)
                where += f" AND seq {'<' if descending else '>'} ?"
                params = [*params, row[0]]
            rows = self._conn.execute(
                f"SELECT {', '.join(columns)} FROM {table} WHERE {where} "
                f"ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT ?",
                [*params, limit + 1],
            ).fetchall()
        return rows[:limit], len(rows) > limit


def fsync_dir(path: str) -> None:
    """Make the names in a folder (a file just created or renamed) survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _marks(values: Iterable[Any]) -> str:
    return ", ".join("?" for _ in values)


def _lock_folder(path: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirError(
            f"another gramserve server uses the data folder {os.path.dirname(path)} (give each server its own "
            "--data-dir)"
        ) from None
    return fd
