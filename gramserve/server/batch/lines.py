"""A batch input file's lines: checking their envelope (`custom_id`, `method`, `url`, `body`) and reading them back.

Validation reads the whole file once and keeps where each request line is (offset and length), not its body, so a
200 MB file costs a few MB of memory; a line's body is read again when it runs. The body itself is checked when it
runs, by the same code as the HTTP route (a bad one becomes that line's 400 in the error file, as with OpenAI).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from gramserve.server.errors import InvalidRequestError
from gramserve.server.request_body import parse_json_object

MAX_REPORTED_ERRORS = 100  # a failed batch lists at most this many line errors (OpenAI's errors.data)
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class LineRef:
    """Where one request line of an input file is."""

    number: int  # 1-based line number in the file
    custom_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class LineError:
    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "line": self.line, "param": self.param}


@dataclass
class ScannedInput:
    lines: list[LineRef]
    errors: list[LineError]
    error_count: int  # errors found, including those past MAX_REPORTED_ERRORS


def is_blank(raw: bytes) -> bool:
    return not raw.strip()


class LineCounter:
    """Counts the non-blank lines of a file fed in pieces (an upload), wherever the pieces cut the lines."""

    def __init__(self) -> None:
        self.count = 0
        self._open_line_has_text = False

    def feed(self, chunk: bytes) -> None:
        parts = chunk.split(b"\n")
        for part in parts[:-1]:  # each of these ends with a newline
            if self._open_line_has_text or not is_blank(part):
                self.count += 1
            self._open_line_has_text = False
        if not is_blank(parts[-1]):
            self._open_line_has_text = True

    def finish(self) -> int:
        if self._open_line_has_text:
            self.count += 1
            self._open_line_has_text = False
        return self.count


def _envelope_error(number: int, obj: dict[str, Any], endpoint: str, seen: set[str]) -> LineError | None:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            "invalid_custom_id", f"Line {number}: custom_id must be a non-empty string.", number, "custom_id"
        )
    if custom_id in seen:
        return LineError(
            "duplicate_custom_id",
            f"Line {number}: the custom_id {custom_id!r} is used by an earlier line; each must be unique.",
            number,
            "custom_id",
        )
    if obj.get("method") != "POST":
        return LineError(
            "invalid_method", f"Line {number}: method must be 'POST', got {obj.get('method')!r}.", number, "method"
        )
    if obj.get("url") != endpoint:
        return LineError(
            "mismatched_url",
            f"Line {number}: url must be the batch's endpoint {endpoint!r}, got {obj.get('url')!r}.",
            number,
            "url",
        )
    if not isinstance(obj.get("body"), dict):
        return LineError("invalid_body", f"Line {number}: body must be a JSON object.", number, "body")
    return None


def scan_input(path: str, endpoint: str, max_requests: int) -> ScannedInput:
    """Check every line of an input file; the request lines' places, or the errors that fail the batch."""
    lines: list[LineRef] = []
    errors: list[LineError] = []
    error_count = 0
    seen: set[str] = set()
    offset = 0

    def add(error: LineError) -> None:
        nonlocal error_count
        error_count += 1
        if len(errors) < MAX_REPORTED_ERRORS:
            errors.append(error)

    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(UTF8_BOM):  # a file saved by an editor that marks UTF-8
                start, raw = start + len(UTF8_BOM), raw[len(UTF8_BOM) :]
            if is_blank(raw):
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:  # named as such: "not valid JSON" sent users looking at the JSON
                msg = f"Line {number} is not UTF-8 (byte {exc.start + 1} of the line); save the file as UTF-8."
                add(LineError("invalid_json_line", msg, number))
                continue
            try:
                obj = parse_json_object(raw)
            except InvalidRequestError as exc:
                add(LineError("invalid_json_line", f"Line {number} is not a valid request line: {exc}.", number))
                continue
            error = _envelope_error(number, obj, endpoint, seen)
            if error is not None:
                add(error)
                continue
            seen.add(obj["custom_id"])
            lines.append(LineRef(number, obj["custom_id"], start, len(raw)))
    if not lines and not error_count:
        add(LineError("empty_file", "The input file holds no request lines."))
    if len(lines) > max_requests:
        add(
            LineError(
                "too_many_requests",
                f"The input file holds {len(lines)} requests, more than the {max_requests} one batch may hold "
                "(--batch-max-requests).",
            )
        )
    return ScannedInput(lines, errors, error_count)


def read_body(fd: int, ref: LineRef) -> dict[str, Any]:
    """A request line's body (its envelope was checked when the batch was validated)."""
    raw = os.pread(fd, ref.length, ref.offset)
    body = json.loads(raw)["body"]
    if not isinstance(body, dict):
        raise ValueError(f"line {ref.number} changed since the batch was validated")
    return body
