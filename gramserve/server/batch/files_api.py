"""OpenAI's Files API, for batch input and output files: POST /v1/files (multipart upload, purpose "batch"),
GET /v1/files (list), GET /v1/files/{id}, DELETE /v1/files/{id}, GET /v1/files/{id}/content (the raw bytes)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Literal, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from gramserve.config import ServerArgs
from gramserve.server.batch import models as M
from gramserve.server.batch.service import BatchService
from gramserve.server.batch.store import BatchStore, FileRecord, UnknownCursorError, fsync_dir, new_id, now
from gramserve.server.batch.upload import receive_upload
from gramserve.server.errors import InvalidRequestError

UPLOAD_PURPOSE = "batch"
READ_BYTES = 1 << 20


def find_file(store: BatchStore, file_id: str) -> FileRecord:
    record = store.get_file(file_id)
    if record is None:
        raise HTTPException(404, f"No such File object: {file_id}")
    return record


def _check_purpose(purpose: str | None) -> None:
    if purpose is None:
        raise InvalidRequestError("purpose is required: upload batch input files with purpose 'batch'", "purpose")
    if purpose != UPLOAD_PURPOSE:
        raise InvalidRequestError(
            f"purpose {purpose!r} is not supported: this server takes files for the Batch API only (purpose 'batch')",
            "purpose",
        )


def _chunks(f) -> Iterator[bytes]:
    with f:
        while chunk := f.read(READ_BYTES):
            yield chunk


def files_router(service: BatchService, args: ServerArgs) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    async def create_file(request: Request):
        store = service.require_store()
        file_id = new_id("file-")
        partial = store.upload_path(file_id)
        upload = await receive_upload(request, partial, args.max_file_bytes)
        try:
            _check_purpose(upload.fields.get("purpose"))
            os.replace(partial, store.file_path(file_id))
            fsync_dir(store.files_dir)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise
        record = FileRecord(file_id, upload.filename, UPLOAD_PURPOSE, upload.bytes, upload.lines, now())
        store.add_file(record)
        return JSONResponse(record.to_api().model_dump())

    @router.get("/v1/files")
    async def list_files(
        limit: int = Query(10_000, ge=1, le=10_000),
        order: Literal["asc", "desc"] = "desc",
        after: Optional[str] = None,
        purpose: Optional[str] = None,
    ):
        try:
            records, has_more = service.require_store().list_files(limit, after, order, purpose)
        except UnknownCursorError:
            raise InvalidRequestError(f"after: there is no file {after}", "after") from None
        page = M.FileList(
            data=[r.to_api() for r in records],
            first_id=records[0].id if records else None,
            last_id=records[-1].id if records else None,
            has_more=has_more,
        )
        return JSONResponse(page.model_dump())

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return JSONResponse(find_file(service.require_store(), file_id).to_api().model_dump())

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        store = service.require_store()
        find_file(store, file_id)
        reader = store.active_batch_reading(file_id)
        if reader is not None:
            raise InvalidRequestError(
                f"the file {file_id} is the input of batch {reader}, which has not finished: cancel it or wait",
                "file_id",
            )
        if store.delete_file(file_id):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(store.file_path(file_id))
        return JSONResponse(M.FileDeleted(id=file_id, deleted=True).model_dump())

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        store = service.require_store()
        find_file(store, file_id)
        try:
            f = open(store.file_path(file_id), "rb")
        except FileNotFoundError:
            raise HTTPException(404, f"No such File object: {file_id}") from None
        size = os.fstat(f.fileno()).st_size
        return StreamingResponse(
            _chunks(f), media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    return router
