"""The documents of an extraction job: JSON Lines (one object per line) or a folder of .txt / .md files.

Reading never stops at a bad document: a line that is not a JSON object, lacks its text field, or repeats an id
comes back as a `BadDocument`, which the job reports in its output line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    record: dict[str, Any] = field(default_factory=dict)  # the whole JSON line (for the prompt template)


@dataclass(frozen=True)
class BadDocument:
    id: str
    error: str


def read_documents(path: str, text_field: str = "text", id_field: str = "id") -> Iterator[Document | BadDocument]:
    """Documents in input order, each id once. JSON Lines: the id is `id_field` when present, else "line-N" (N counts
    from 1; also the id of a line that repeats an earlier line's id, reported as bad); a folder: the file's path below
    it."""
    if os.path.isdir(path):
        yield from _read_folder(path)
    else:
        yield from _read_jsonl(path, text_field, id_field)


def _read_folder(root: str) -> Iterator[Document | BadDocument]:
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(TEXT_SUFFIXES):
                continue
            path = os.path.join(folder, name)
            doc_id = os.path.relpath(path, root)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                yield BadDocument(doc_id, f"cannot read {path}: {exc}")
                continue
            yield _checked(Document(doc_id, text, {"path": doc_id}))


def _read_jsonl(path: str, text_field: str, id_field: str) -> Iterator[Document | BadDocument]:
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            fallback = f"line-{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield BadDocument(fallback, f"line {number} is not JSON: {exc}")
                continue
            if not isinstance(record, dict):
                yield BadDocument(fallback, f"line {number} is not a JSON object")
                continue
            raw_id = record.get(id_field)
            doc_id = fallback if raw_id is None or isinstance(raw_id, (dict, list)) else str(raw_id)
            if doc_id in seen:
                yield BadDocument(fallback, f"line {number} repeats the id {doc_id!r} of an earlier line")
                continue
            seen.add(doc_id)
            text = record.get(text_field)
            if not isinstance(text, str):
                yield BadDocument(doc_id, f"line {number} has no string field {text_field!r} (--field)")
                continue
            yield _checked(Document(doc_id, text, record))


def _checked(doc: Document) -> Document | BadDocument:
    if not doc.text.strip():
        return BadDocument(doc.id, "the document's text is empty")
    return doc
