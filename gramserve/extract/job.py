"""An extraction job: every document through the Engine's chat with the schema as `response_format`, one JSON line
per document in the output, in the order they finish.

Each output line is `{"id", "status": "ok" | "error", "data", "error", "finish_reason", "usage"}`: `data` is the
extracted object (validated against the schema here too), `error` says why a document failed (a bad input line, a
document longer than the context, an output cut at max_tokens, ...). A failure is reported in its line and the job
goes on. Lines are flushed as they are written, so a job stopped midway resumes: a re-run skips the ids already in
the output (`--retry-failed`: only those that succeeded). A summary ends the job.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import jsonschema
from tqdm import tqdm

from gramserve.extract.documents import BadDocument, Document, read_documents
from gramserve.extract.prompts import PromptBuilder, TemplateError

RAW_OUTPUT_CHARS = 2000  # how much of a failed output its line keeps, for debugging


@dataclass(frozen=True)
class ExtractConfig:
    schema_path: str
    input_path: str
    output_path: str
    text_field: str = "text"
    id_field: str = "id"
    prompt_template: str | None = None  # a file; None: prompts.DEFAULT_TEMPLATE
    system_prompt: str | None = None  # None: prompts.DEFAULT_SYSTEM
    max_tokens: int = 1024
    temperature: float = 0.0
    concurrency: int | None = None  # documents in flight; None: the engine's max running requests
    retry_failed: bool = False
    limit: int | None = None  # only the first N documents of the input
    progress: bool = True


@dataclass
class Summary:
    documents: int = 0  # in the input (up to --limit)
    skipped: int = 0  # already in the output (a resumed job)
    done: int = 0  # extracted, valid
    failed: int = 0
    invalid: int = 0  # returned as a success but breaking the schema (must stay 0)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)  # failure kind -> count

    @property
    def validity_rate(self) -> float:
        """Of the outputs returned as extracted, the share that validates (1.0 by construction)."""
        returned = self.done + self.invalid
        return self.done / returned if returned else 1.0

    def to_dict(self) -> dict:
        run = self.done + self.failed
        out = asdict(self)
        out["validity_rate"] = self.validity_rate
        out["documents_per_s"] = run / self.seconds if self.seconds else 0.0
        out["output_tokens_per_s"] = self.completion_tokens / self.seconds if self.seconds else 0.0
        return out

    def text(self) -> str:
        d = self.to_dict()
        lines = [
            f"documents {self.documents}: done {self.done}, failed {self.failed}, skipped (already in the output) "
            f"{self.skipped}",
            f"validity: {self.validity_rate:.1%} of the returned objects validate against the schema"
            if self.done + self.invalid
            else "validity: n/a (no object returned)",
            f"{self.seconds:.1f} s: {d['documents_per_s']:.2f} documents/s, {d['output_tokens_per_s']:.1f} output "
            f"tokens/s; prompt tokens {self.prompt_tokens} ({self.cached_tokens} from the prefix cache)",
        ]
        if self.errors:
            lines.append("failures: " + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())))
        return "\n".join(lines)


class OutputFile:
    """The job's output: which ids it already holds, and appending lines that survive a crash."""

    def __init__(self, path: str, retry_failed: bool):
        self.path = path
        self.finished, kept = read_output(path, retry_failed)
        if kept is not None:  # rewritten without the lines to run again (or a torn last line)
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, item: dict) -> None:
        self._file.write(json.dumps(item, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_output(path: str, retry_failed: bool) -> tuple[set[str], list[str] | None]:
    """The ids an existing output holds, and the lines to keep when it must be rewritten (None: kept as it is).
    Only a torn last line (a crash mid-write) and, with `retry_failed`, the failed documents' lines are dropped; any
    other line that is not one of a job's records makes it a ValueError that names the line: a re-run never deletes
    what it did not write (an --output given the input file, or another file, lost its lines that way)."""
    finished: set[str] = set()
    if not os.path.exists(path):
        return finished, None
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    kept, rewrite = [], False
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
            ours = isinstance(item, dict) and "id" in item and item.get("status") in ("ok", "error")
        except json.JSONDecodeError:
            ours = False
        if not ours:
            if number == len(lines) and not line.endswith("\n"):
                rewrite = True  # a line torn by a crash: dropped, its document runs again
                continue
            raise ValueError(
                f"--output {path}: line {number} is not a line of an extraction output ({line.strip()[:80]!r}); "
                "give a new file, or the output of an earlier run of this job"
            )
        if retry_failed and item["status"] != "ok":
            rewrite = True
            continue
        finished.add(str(item["id"]))
        kept.append(line)
    return finished, kept if rewrite else None


def load_schema(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            schema = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{path}: a JSON schema must be an object")
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{path} is not a valid JSON schema: {exc.message}") from None
    return schema


class ExtractionJob:
    """A job's schema, prompts and validator, loaded (and checked) before any model starts; `run(engine)` runs it."""

    def __init__(self, config: ExtractConfig):
        self.engine = None
        self.config = config
        self.schema = load_schema(config.schema_path)
        template = None
        if config.prompt_template:
            with open(config.prompt_template, encoding="utf-8") as f:
                template = f.read()
        builder_args = {"schema": self.schema}
        if template is not None:
            builder_args["template"] = template
        if config.system_prompt is not None:
            builder_args["system"] = config.system_prompt or None
        self.prompts = PromptBuilder(**builder_args)
        if not os.path.exists(config.input_path):
            raise ValueError(f"--input {config.input_path}: no such file or folder")
        out_dir = os.path.dirname(os.path.abspath(config.output_path))
        if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
            raise ValueError(f"--output {config.output_path}: the folder {out_dir} does not exist or is not writable")
        if os.path.isdir(config.output_path):
            raise ValueError(f"--output {config.output_path} is a folder: give a file")
        if os.path.exists(config.output_path) and os.path.samefile(config.input_path, config.output_path):
            raise ValueError(f"--output {config.output_path} is the input file: give another file")
        read_output(config.output_path, config.retry_failed)  # an output this job can resume, or a ValueError
        if config.concurrency is not None and config.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {config.concurrency}")
        # checked here, not per document: a bad setting would write every document as an error, which a re-run
        # then skips as done
        if config.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {config.max_tokens}")
        if not 0 <= config.temperature <= 100:
            raise ValueError(f"--temperature must be in [0, 100], got {config.temperature}")
        if config.limit is not None and config.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {config.limit}")
        cls = jsonschema.validators.validator_for(self.schema)
        self.validator = cls(self.schema, format_checker=cls.FORMAT_CHECKER)
        name = os.path.splitext(os.path.basename(config.schema_path))[0] or "extraction"
        self.response_format = {
            "type": "json_schema",
            "json_schema": {"name": "".join(c if c.isalnum() else "_" for c in name)[:64], "schema": self.schema},
        }
        self.summary = Summary()

    def run(self, engine) -> Summary:
        return asyncio.run(self.run_async(engine))

    async def run_async(self, engine) -> Summary:
        self.engine = engine
        config, summary = self.config, self.summary
        output = OutputFile(config.output_path, config.retry_failed)
        docs = []
        for doc in read_documents(config.input_path, config.text_field, config.id_field):
            if config.limit is not None and summary.documents >= config.limit:
                break
            summary.documents += 1
            if doc.id in output.finished:
                summary.skipped += 1
            else:
                docs.append(doc)
        concurrency = config.concurrency or self.engine.max_running_requests
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(docs), desc="extract", unit="doc", file=sys.stderr, disable=not config.progress)
        start = time.monotonic()

        async def one(doc: Document | BadDocument) -> None:
            async with gate:
                item = await self._extract(doc)
            kind = item.pop("_kind", None)
            try:
                output.write(item)
            except (ValueError, UnicodeError) as exc:  # e.g. a lone surrogate in the output: reported, not fatal
                kind = "output"
                item = {"id": doc.id, "status": "error", "data": None, "error": f"cannot write the result: {exc}"}
                output.write(item)
            self._count(item, kind)
            bar.update(1)
            elapsed = time.monotonic() - start
            bar.set_postfix(tok_s=f"{summary.completion_tokens / elapsed:.0f}", failed=summary.failed, refresh=False)

        try:
            if docs:
                await self._cache_shared_prefix()
            await asyncio.gather(*(one(doc) for doc in docs))
        finally:
            summary.seconds = time.monotonic() - start
            bar.close()
            output.close()
        return summary

    async def _cache_shared_prefix(self) -> None:
        """Prefill the instruction and schema that every prompt starts with, once, before the documents go in
        together: each of them then finds it in the prefix cache instead of computing it again side by side."""
        system = self.prompts.system_message()
        if system is None:
            return
        messages = [system, {"role": "user", "content": ""}]
        try:
            await self.engine.async_chat(messages, max_tokens=1, temperature=0.0)
        except ValueError:  # e.g. a system prompt longer than the context: each document reports it
            pass

    async def _extract(self, doc: Document | BadDocument) -> dict:
        if isinstance(doc, BadDocument):
            return _line(doc.id, error=doc.error, kind="bad_input")
        try:
            messages = self.prompts.messages(doc.id, doc.text, doc.record)
        except TemplateError as exc:
            return _line(doc.id, error=str(exc), kind="template")
        try:
            resp = await self.engine.async_chat(
                messages,
                response_format=self.response_format,
                max_tokens=self.config.max_tokens,
                temperature=self.config.temperature,
            )
        except ValueError as exc:  # InvalidRequestError: e.g. a document longer than the context
            return _line(doc.id, error=str(exc), kind="refused")
        except Exception as exc:  # noqa: BLE001 - reported in the document's line; the job goes on
            return _line(doc.id, error=f"{type(exc).__name__}: {exc}", kind="engine")
        choice = resp["choices"][0]
        content = choice["message"]["content"] or ""
        reason = choice["finish_reason"]
        usage = resp.get("usage") or {}
        if reason == "length":
            error = f"the output was cut at max_tokens ({self.config.max_tokens}); raise --max-tokens"
            return _line(doc.id, error=error, kind="length", reason=reason, usage=usage, raw=content)
        if reason != "stop":
            return _line(doc.id, error=f"the output ended with {reason}", kind=reason, reason=reason, usage=usage)
        try:
            data = json.loads(content)
        except json.JSONDecodeError as exc:
            return _line(doc.id, error=f"not JSON: {exc}", kind="invalid", reason=reason, usage=usage, raw=content)
        problem = next(iter(self.validator.iter_errors(data)), None)
        if problem is not None:
            error = f"breaks the schema: {problem.message}"
            return _line(doc.id, error=error, kind="invalid", reason=reason, usage=usage, raw=content)
        return {"id": doc.id, "status": "ok", "data": data, "error": None, "finish_reason": reason, "usage": usage}

    def _count(self, item: dict, kind: str | None) -> None:
        s = self.summary
        usage = item.get("usage") or {}
        s.prompt_tokens += usage.get("prompt_tokens", 0)
        s.completion_tokens += usage.get("completion_tokens", 0)
        s.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if item["status"] == "ok":
            s.done += 1
            return
        s.failed += 1
        s.errors[kind] = s.errors.get(kind, 0) + 1
        if kind == "invalid":
            s.invalid += 1


def _line(doc_id: str, *, error: str, kind: str, reason: str | None = None, usage=None, raw: str | None = None) -> dict:
    item: dict[str, Any] = {
        "id": doc_id,
        "status": "error",
        "data": None,
        "error": error,
        "finish_reason": reason,
        "usage": usage,
    }
    if raw is not None:
        item["raw_output"] = raw[:RAW_OUTPUT_CHARS]
    item["_kind"] = kind  # counted in the summary, removed before the line is written
    return item
