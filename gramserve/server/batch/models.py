"""The Batch API's JSON shapes, as OpenAI's (and the `openai` SDK's types) have them: file objects, batch objects,
their lists, the batch creation body, and one line of a batch's output or error file."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: Optional[int] = None
    status_details: Optional[str] = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreateRequest(BaseModel):
    """POST /v1/batches. Unknown fields are ignored, as on the generation routes."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[dict[str, str]] = None
    output_expires_after: Optional[dict[str, Any]] = None  # accepted; outputs are kept until deleted


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: Optional[str] = None
    message: Optional[str] = None
    param: Optional[str] = None
    line: Optional[int] = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: Optional[BatchErrors] = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: Optional[str] = None
    error_file_id: Optional[str] = None
    created_at: int
    in_progress_at: Optional[int] = None
    expires_at: Optional[int] = None
    finalizing_at: Optional[int] = None
    completed_at: Optional[int] = None
    failed_at: Optional[int] = None
    expired_at: Optional[int] = None
    cancelling_at: Optional[int] = None
    cancelled_at: Optional[int] = None
    request_counts: BatchRequestCounts
    metadata: Optional[dict[str, str]] = None
    model: Optional[str] = None
    usage: Optional[BatchUsage] = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: Optional[str] = None
    last_id: Optional[str] = None
    has_more: bool = False


class LineResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineFailure(BaseModel):
    code: str
    message: str


class OutputLine(BaseModel):
    """One line of a batch's output file (status 200) or error file (any other status, or `error`)."""

    id: str
    custom_id: str
    response: Optional[LineResponse] = None
    error: Optional[LineFailure] = None
