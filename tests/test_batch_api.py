"""The OpenAI Batch API against a real server, driven with the `openai` SDK: files, batches, their outputs and errors,
malformed inputs, limits, cancel, pagination, interactive requests beside a batch, and a restart in the middle of a
batch (docs/batch.md).

One server serves the whole file (two server starts in all: the last test restarts it), with small limits so they
are cheap to hit: --max-file-bytes 200000, --batch-max-requests 50, --batch-max-in-flight 8, --shutdown-timeout 0
(lines running at a SIGTERM fail at once and must run again after the restart).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest
from conftest import ServerProcess, start_server

MAX_FILE_BYTES = 200_000
MAX_REQUESTS = 50
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@dataclass
class Deployment:
    """The server of this file (the restart test replaces it) and its data folder."""

    tmp_dir: str
    data_dir: str
    server: ServerProcess | None = None

    def start(self, *extra: str) -> None:
        self.server = start_server(
            self.tmp_dir,
            "--data-dir",
            self.data_dir,
            "--max-file-bytes",
            str(MAX_FILE_BYTES),
            "--batch-max-requests",
            str(MAX_REQUESTS),
            "--batch-max-in-flight",
            "8",
            "--shutdown-timeout",
            "0",
            "--num-threads",  # the 2 cores are shared with the test process and other work
            "1",
            *extra,
        )

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.base_url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("batch"))
    dep = Deployment(tmp, os.path.join(tmp, "data"))
    dep.start("--skip-warmup")
    yield dep
    assert dep.server.stop() == 0, dep.server.log()[-3000:]


@pytest.fixture
def client(deployment) -> openai.OpenAI:
    return deployment.client()


def chat_line(custom_id: str, content: str = "Say hi.", **body) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def upload(client: openai.OpenAI, lines: list, name: str = "input.jsonl"):
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def submit(client: openai.OpenAI, lines: list, endpoint: str = CHAT, **kwargs):
    source = upload(client, lines)
    return client.batches.create(input_file_id=source.id, endpoint=endpoint, completion_window="24h", **kwargs)


def wait_for(
    client: openai.OpenAI, batch_id: str, statuses=("completed", "failed", "cancelled"), timeout=120, until=None
):
    """Poll the batch until its status is one of `statuses` (or `until(batch)` holds)."""
    deadline = time.time() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch
        assert time.time() < deadline, f"batch still {batch.status} after {timeout} s: {batch}"
        time.sleep(0.5)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def assert_error_json(exc: openai.APIStatusError, status: int, param: str | None = None) -> dict:
    assert exc.status_code == status, exc
    err = exc.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# --- running batches -----------------------------------------------------------------------------------------


def test_chat_and_completions_batches_run_to_completion(client):
    json_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    chat = [chat_line(f"chat-{i}", f"Count to {i}.") for i in range(4)]
    chat.append(chat_line("json", "Is Paris in France? Answer as JSON.", max_tokens=24, response_format=json_format))
    chat.append(chat_line("bad-temperature", temperature=500))  # past the sampling range: a 400
    chat.append(chat_line("streamed", stream=True))  # refused per line
    chat.append(chat_line("other-model", model="no-such-model"))
    chat_batch = submit(client, chat, metadata={"suite": "batch"})
    assert chat_batch.status == "validating" and chat_batch.metadata == {"suite": "batch"}
    completion_lines = [
        {"custom_id": "text", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "One, two,", "max_tokens": 4}},
        {"custom_id": "two", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "A", "max_tokens": 4, "n": 2}},
    ]
    text_batch = submit(client, completion_lines, endpoint=COMPLETIONS)

    chat_batch = wait_for(client, chat_batch.id)
    text_batch = wait_for(client, text_batch.id)
    assert chat_batch.status == "completed", chat_batch
    assert chat_batch.request_counts.model_dump() == {"total": 8, "completed": 5, "failed": 3}
    assert chat_batch.in_progress_at and chat_batch.finalizing_at and chat_batch.completed_at
    assert chat_batch.usage.input_tokens > 0 and chat_batch.usage.output_tokens > 0
    outputs, errors = results(client, chat_batch.output_file_id), results(client, chat_batch.error_file_id)
    ids = [r["custom_id"] for r in outputs + errors]
    assert sorted(ids) == sorted(line["custom_id"] for line in chat), "every line exactly once"
    for r in outputs:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        resp = r["response"]
        assert resp["status_code"] == 200 and resp["body"]["object"] == "chat.completion"
        assert resp["body"]["id"] == f"chatcmpl-{resp['request_id']}"
        assert resp["body"]["usage"]["completion_tokens"] > 0
    answer = next(r for r in outputs if r["custom_id"] == "json")["response"]["body"]["choices"][0]["message"]
    jsonschema.validate(json.loads(answer["content"]), ANSWER_SCHEMA)
    by_id = {r["custom_id"]: r["response"] for r in errors}
    assert by_id["bad-temperature"]["status_code"] == 400
    assert by_id["bad-temperature"]["body"]["error"]["param"] == "temperature"
    assert by_id["streamed"]["status_code"] == 400 and by_id["streamed"]["body"]["error"]["param"] == "stream"
    assert by_id["other-model"]["status_code"] == 404
    assert by_id["other-model"]["body"]["error"]["code"] == "model_not_found"

    output_file = client.files.retrieve(chat_batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes > 0

    assert text_batch.status == "completed" and text_batch.error_file_id is None
    texts = {r["custom_id"]: r["response"]["body"] for r in results(client, text_batch.output_file_id)}
    assert set(texts) == {"text", "two"}
    assert texts["text"]["object"] == "text_completion" and len(texts["two"]["choices"]) == 2


def test_a_malformed_input_file_fails_the_batch_with_line_numbers(client):
    lines = [
        chat_line("ok"),
        "this is not json",
        {"method": "POST", "url": CHAT, "body": {}},
        chat_line("ok"),
        {**chat_line("get"), "method": "GET"},
        {**chat_line("url"), "url": COMPLETIONS},
        {**chat_line("body"), "body": "hello"},
        "",  # blank lines are skipped
        "[1, 2]",
    ]
    batch = wait_for(client, submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at, batch
    errors = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert errors == [
        (2, "invalid_json_line", None),
        (3, "invalid_custom_id", "custom_id"),
        (4, "duplicate_custom_id", "custom_id"),
        (5, "invalid_method", "method"),
        (6, "mismatched_url", "url"),
        (7, "invalid_body", "body"),
        (9, "invalid_json_line", None),
    ]
    assert all(e.message for e in batch.errors.data)
    assert batch.output_file_id is None and batch.request_counts.total == 0

    empty = wait_for(client, submit(client, ["", "  "]).id)
    assert empty.status == "failed" and empty.errors.data[0].code == "empty_file"

    # A Latin-1 line is named as not UTF-8 (its message said "not valid JSON").
    latin = json.dumps(chat_line("a")) + "\n" + json.dumps(chat_line("caf\u00e9"), ensure_ascii=False)
    latin = latin.encode("latin-1")
    source = client.files.create(file=("latin.jsonl", latin), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    error = wait_for(client, batch.id).errors.data[0]
    assert (error.line, error.code) == (2, "invalid_json_line") and "not UTF-8" in error.message, error


def test_bad_batch_requests_get_openai_errors(client):
    source = upload(client, [chat_line("a")])
    with pytest.raises(openai.NotFoundError) as exc:
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    assert_error_json(exc.value, 404)
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=source.id, endpoint="/v1/embeddings", completion_window="24h")
    assert_error_json(exc.value, 400, "endpoint")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="1h")
    assert_error_json(exc.value, 400, "completion_window")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h", metadata={"k" * 65: "v"})
    assert_error_json(exc.value, 400, "metadata")
    r = httpx.post(client.base_url.join("batches"), content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]

    too_many = upload(client, [chat_line(f"r{i}") for i in range(MAX_REQUESTS + 1)])
    assert too_many.purpose == "batch"
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(input_file_id=too_many.id, endpoint=CHAT, completion_window="24h")
    assert "--batch-max-requests" in assert_error_json(exc.value, 400, "input_file_id")["message"]

    for call in (client.batches.retrieve, client.batches.cancel):
        with pytest.raises(openai.NotFoundError) as exc:
            call("batch_nope")
        assert_error_json(exc.value, 404)
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.list(after="batch_nope")
    assert_error_json(exc.value, 400, "after")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.list(limit=0)
    assert_error_json(exc.value, 400, "limit")  # the query field's name, not FastAPI's "query"


# --- files -------------------------------------------------------------------------------------------------


def test_files_upload_list_retrieve_content_delete(client, deployment):
    data = jsonl([chat_line("a"), chat_line("b")])
    first = client.files.create(file=("first.jsonl", data), purpose="batch")
    second = client.files.create(file=("second.jsonl", b"{}\n"), purpose="batch")
    assert first.object == "file" and first.bytes == len(data) and first.filename == "first.jsonl"
    assert first.purpose == "batch" and first.status == "processed" and first.created_at > 0
    assert client.files.retrieve(first.id) == first
    assert client.files.content(first.id).content == data

    page = client.files.list(limit=1, purpose="batch")
    assert [f.id for f in page.data] == [second.id] and page.has_more  # newest first
    assert [f.id for f in client.files.list(limit=1, after=second.id).data] == [first.id]
    oldest_first = [f.id for f in client.files.list(order="asc").data]
    assert oldest_first.index(first.id) < oldest_first.index(second.id)

    deleted = client.files.delete(second.id)
    assert deleted.deleted and deleted.id == second.id
    for call in (client.files.retrieve, client.files.delete, client.files.content):
        with pytest.raises(openai.NotFoundError) as exc:
            call(second.id)
        assert_error_json(exc.value, 404)
    assert second.id not in [f.id for f in client.files.list().data]
    assert not os.path.exists(os.path.join(deployment.data_dir, "files", second.id))


def test_upload_limits_and_purpose(client, deployment):
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert "--max-file-bytes" in assert_error_json(exc.value, 413)["message"]
    r = httpx.post(  # declared too large: refused before the body is read
        deployment.server.base_url + "/v1/files",
        files={"file": ("big.jsonl", b"x" * (2 * MAX_FILE_BYTES + 3_000_000))},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert r.status_code == 413 and "--max-file-bytes" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    assert "'batch'" in assert_error_json(exc.value, 400, "purpose")["message"]
    r = httpx.post(deployment.server.base_url + "/v1/files", data={"purpose": "batch"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(deployment.server.base_url + "/v1/files", json={"purpose": "batch"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    leftovers = [n for n in os.listdir(os.path.join(deployment.data_dir, "files")) if n.endswith(".partial")]
    assert not leftovers


# --- pagination, priority, cancel --------------------------------------------------------------------------


def test_batch_list_pagination(client):
    made = [submit(client, ["not json"]).id for _ in range(3)]  # fail at once: no generation
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more  # newest first
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == made[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the SDK follows the pages
    assert every[:3] == made[::-1] and len(every) == len(set(every))
    raw = httpx.get(str(client.base_url.join("batches")), params={"limit": 1}).json()
    assert raw["object"] == "list" and raw["first_id"] == raw["last_id"] == made[-1] and raw["has_more"] is True


def test_interactive_requests_pass_a_running_batch_and_cancel_stops_it(client):
    lines = [chat_line(f"long-{i}", max_tokens=48, ignore_eos=True) for i in range(24)]
    batch = submit(client, lines)
    batch = wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
    assert batch.status == "in_progress"
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.delete(batch.input_file_id)  # a running batch reads it
    assert_error_json(exc.value, 400, "file_id")

    start = time.time()
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, extra_body={"ignore_eos": True}
    )
    waited = time.time() - start
    assert reply.usage.completion_tokens == 8
    # 8 batch lines decode beside it; it is never queued behind the batch's 16 other lines
    assert waited < 20, f"an interactive request took {waited:.1f} s beside a batch"

    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    batch = wait_for(client, batch.id, timeout=30)
    assert batch.status == "cancelled" and batch.cancelled_at, batch
    counts = batch.request_counts
    assert counts.total == 24 and 1 <= counts.completed < 24 and counts.failed == 0
    outputs = results(client, batch.output_file_id)
    assert len(outputs) == counts.completed and len({r["custom_id"] for r in outputs}) == counts.completed
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the same answer
    finished = wait_for(client, submit(client, [chat_line("x", max_tokens=2)]).id)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(finished.id)  # completed: too late


# --- restart -----------------------------------------------------------------------------------------------


def test_a_restart_mid_batch_loses_nothing_and_runs_nothing_twice(deployment):
    client = deployment.client()
    lines = [
        chat_line(f"line-{i:02d}", f"Write about the number {i}.", max_tokens=16, ignore_eos=True) for i in range(40)
    ]
    batch = submit(client, lines)
    batch = wait_for(client, batch.id, until=lambda b: b.request_counts.completed >= 6)
    assert batch.status == "in_progress" and batch.request_counts.completed < 40, batch
    assert deployment.server.stop() == 0  # SIGTERM, --shutdown-timeout 0: the lines running now fail
    log = deployment.server.log()
    assert "it will run again" in log  # lines were running at the SIGTERM: aborted, not recorded

    deployment.start()  # warm-up on: the resumed batch waits for it
    client = deployment.client()
    batch = wait_for(client, batch.id, timeout=150)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 40, "completed": 40, "failed": 0}
    assert batch.error_file_id is None
    outputs = results(client, batch.output_file_id)
    ids = [r["custom_id"] for r in outputs]
    assert sorted(ids) == [line["custom_id"] for line in lines], "every line exactly once"
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 16 for r in outputs)
    assert "resuming 1 unfinished batches" in deployment.server.log()
