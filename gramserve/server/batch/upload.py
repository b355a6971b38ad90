"""Receiving the body of POST /v1/files: a multipart form streamed straight into its file under the data folder (never
held whole in memory or spooled to a temporary folder), the file part bounded by --max-file-bytes (a 413 as soon
as it passes), its lines counted on the way, and the file fsync'd before it counts as uploaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from typing import BinaryIO

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.exceptions import HTTPException

from gramserve.server.batch.lines import LineCounter
from gramserve.server.errors import InvalidRequestError

FILE_FIELD = "file"
MAX_FIELDS = 16  # form fields beside the file (purpose, expires_after[...], ...)
MAX_FIELD_BYTES = 64 * 1024
# The body limit of POST /v1/files is --max-file-bytes plus this: the fields and part headers around the file.
ENVELOPE_BYTES = MAX_FIELDS * MAX_FIELD_BYTES + 64 * 1024
WRITE_BYTES = 1 << 20  # file data is written in pieces of about this size, off the event loop
FORM_HELP = "POST /v1/files takes a multipart/form-data body with a 'file' part and a 'purpose' field"


def too_large_message(max_file_bytes: int) -> str:
    return f"the file is larger than the {max_file_bytes}-byte limit (--max-file-bytes)"


@dataclass
class Upload:
    filename: str
    bytes: int
    lines: int  # non-blank lines
    fields: dict[str, str] = field(default_factory=dict)


class _FormParts:
    """The multipart parser's callbacks: small fields kept, the file part's data handed out to be written."""

    def __init__(self, max_file_bytes: int):
        self.max_file_bytes = max_file_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None  # set once the file part starts
        self.file_bytes = 0
        self.lines = LineCounter()
        self.file_data: list[bytes] = []  # received, not written yet
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._name = ""
        self._in_file = False
        self._value = bytearray()

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value_part,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def take_file_data(self) -> list[bytes]:
        data, self.file_data = self.file_data, []
        return data

    def _part_begin(self) -> None:
        self._disposition, self._name, self._in_file, self._value = b"", "", False, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_part(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.strip().lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise InvalidRequestError(f"a form part has no name; {FORM_HELP}")
        self._name = name.decode("utf-8", "replace")
        if self._name == FILE_FIELD:
            if self.filename is not None:
                raise InvalidRequestError("only one file may be uploaded per request", FILE_FIELD)
            self._in_file = True
            self.filename = _clean_filename(options.get(b"filename", b"").decode("utf-8", "replace"))
        elif len(self.fields) >= MAX_FIELDS:
            raise InvalidRequestError(f"the form has more than {MAX_FIELDS} fields")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if not self._in_file:
            if len(self._value) + len(piece) > MAX_FIELD_BYTES:
                raise InvalidRequestError(f"the form field {self._name!r} is longer than {MAX_FIELD_BYTES} bytes")
            self._value += piece
            return
        self.file_bytes += len(piece)
        if self.file_bytes > self.max_file_bytes:
            raise HTTPException(413, too_large_message(self.max_file_bytes))
        self.lines.feed(piece)
        self.file_data.append(piece)

    def _part_end(self) -> None:
        if not self._in_file:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


async def receive_upload(request: Request, path: str, max_file_bytes: int) -> Upload:
    """Stream the request's file part into `path` (removed again if anything fails)."""
    content_type, params = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or not params.get(b"boundary"):
        raise InvalidRequestError(FORM_HELP, FILE_FIELD)
    parts = _FormParts(max_file_bytes)
    out = open(path, "wb")
    try:
        await _stream_into(request, MultipartParser(params[b"boundary"], parts.callbacks()), parts, out)
    except BaseException:
        out.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    if parts.filename is None:
        os.unlink(path)
        raise InvalidRequestError(f"the form has no 'file' part; {FORM_HELP}", FILE_FIELD)
    return Upload(parts.filename, parts.file_bytes, parts.lines.finish(), parts.fields)


async def _stream_into(request: Request, parser: MultipartParser, parts: _FormParts, out: BinaryIO) -> None:
    held: list[bytes] = []
    held_bytes = 0
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for piece in parts.take_file_data():
                held.append(piece)
                held_bytes += len(piece)
            if held_bytes >= WRITE_BYTES:
                await asyncio.to_thread(out.write, b"".join(held))
                held, held_bytes = [], 0
        parser.finalize()
    except FormParserError as exc:
        raise InvalidRequestError(f"the multipart body is malformed ({exc}); {FORM_HELP}", FILE_FIELD) from None
    held += parts.take_file_data()
    await asyncio.to_thread(_write_and_close, out, b"".join(held))


def _write_and_close(out: BinaryIO, data: bytes) -> None:
    out.write(data)
    out.flush()
    os.fsync(out.fileno())
    out.close()


def _clean_filename(name: str) -> str:
    """The name part of a client's file name (no folders), at most 255 characters."""
    base = os.path.basename(name.replace("\\", "/")).strip()
    return base[:255] or "upload.jsonl"
