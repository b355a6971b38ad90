"""OpenAI's Batch API: POST /v1/batches, GET /v1/batches (newest first, `limit` / `after`), GET /v1/batches/{id},
POST /v1/batches/{id}/cancel. The runner (runner.py) does the work; these routes only check, record and read."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gramserve.config import ServerArgs
from gramserve.server.batch import models as M
from gramserve.server.batch.execute import ENDPOINTS
from gramserve.server.batch.files_api import UPLOAD_PURPOSE
from gramserve.server.batch.service import BatchService
from gramserve.server.batch.store import BatchRecord, BatchStore, UnknownCursorError, new_id, now
from gramserve.server.errors import InvalidRequestError
from gramserve.server.request_body import parse_body

COMPLETION_WINDOWS = ("24h",)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def find_batch(store: BatchStore, batch_id: str) -> BatchRecord:
    record = store.get_batch(batch_id)
    if record is None:
        raise HTTPException(404, f"No such Batch object: {batch_id}")
    return record


def check_create_request(req: M.BatchCreateRequest) -> None:
    if req.endpoint not in ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint {req.endpoint!r} is not supported: batches run {' or '.join(ENDPOINTS)}", "endpoint"
        )
    if req.completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequestError(
            f"completion_window must be '24h', got {req.completion_window!r}", "completion_window"
        )
    metadata = req.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidRequestError(
                f"metadata keys are at most {MAX_METADATA_KEY} characters, values at most {MAX_METADATA_VALUE}",
                "metadata",
            )


def batches_router(service: BatchService, args: ServerArgs) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches")
    async def create_batch(request: Request):
        store = service.require_store()
        req = await parse_body(request, M.BatchCreateRequest)
        check_create_request(req)
        source = store.get_file(req.input_file_id)
        if source is None:
            raise HTTPException(404, f"No such File object: {req.input_file_id} (input_file_id)")
        if source.purpose != UPLOAD_PURPOSE:
            raise InvalidRequestError(
                f"the file {source.id} has purpose {source.purpose!r}; a batch's input needs purpose 'batch'",
                "input_file_id",
            )
        if source.lines > args.batch_max_requests:
            raise InvalidRequestError(
                f"the input file holds {source.lines} requests, more than the {args.batch_max_requests} a batch "
                "may hold (--batch-max-requests): split it into several batches",
                "input_file_id",
            )
        record = BatchRecord(
            id=new_id("batch_"),
            endpoint=req.endpoint,
            input_file_id=source.id,
            completion_window=req.completion_window,
            status="validating",
            created_at=now(),
            work_output_id=new_id("file-"),
            work_error_id=new_id("file-"),
            metadata=req.metadata,
            model=args.model_name,
        )
        store.add_batch(record)
        service.require_runner().submit(record.id)
        return JSONResponse(record.to_api().model_dump())

    @router.get("/v1/batches")
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: Optional[str] = None):
        try:
            records, has_more = service.require_store().list_batches(limit, after)
        except UnknownCursorError:
            raise InvalidRequestError(f"after: there is no batch {after}", "after") from None
        page = M.BatchList(
            data=[r.to_api() for r in records],
            first_id=records[0].id if records else None,
            last_id=records[-1].id if records else None,
            has_more=has_more,
        )
        return JSONResponse(page.model_dump())

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return JSONResponse(find_batch(service.require_store(), batch_id).to_api().model_dump())

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        store = service.require_store()
        if find_batch(store, batch_id).status in ("validating", "in_progress"):
            service.require_runner().cancel(batch_id)
        record = find_batch(store, batch_id)
        if record.status not in ("cancelling", "cancelled"):
            raise InvalidRequestError(
                f"the batch {batch_id} is {record.status}: only a validating or in-progress batch can be cancelled"
            )
        return JSONResponse(record.to_api().model_dump())

    return router
