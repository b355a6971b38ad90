"""`gramserve extract` run as a user runs it: JSON Lines and folder input, bad documents reported in their lines,
a document longer than the context, resume after an interrupted run, --retry-failed, the summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
GOOD = [
    ("p1", "Alice Martin is 34 years old and lives in Lyon."),
    ("p2", "Meet Bob Stone, 52, a baker from Leeds."),
    ("p3", "Carla Diaz (age 27) moved to Madrid last year."),
    ("p4", "Dan Wu, aged 41, works in Toronto."),
]


def run_extract(tmp_path, *extra: str, context: int = 512) -> tuple[subprocess.CompletedProcess, dict]:
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "gramserve", "extract", "--skip-warmup", "--no-progress"]
    cmd += ["--context-length", str(context), "--max-tokens", "48", "--summary-json", str(summary), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, run.stderr[-3000:]
    result = json.loads(summary.read_text())
    # 1 when a returned object broke the schema or every document run failed (a job that extracted nothing).
    nothing = result["done"] == 0 and result["failed"] > 0
    assert run.returncode == (1 if result["invalid"] or nothing else 0), (run.returncode, result)
    return run, result


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.fixture
def job(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    docs = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": i, "text": t}) for i, t in GOOD]
    lines.insert(2, "{this line is not json")
    lines.append(json.dumps({"id": "no-text", "body": "the text is in the wrong field"}))
    lines.append(json.dumps({"id": "p1", "text": "A second document with an id already used."}))
    lines.append(json.dumps({"id": "huge", "text": "Eve Long is 30 and lives in Oslo. " * 200}))
    docs.write_text("\n".join(lines) + "\n")
    return tmp_path, ["--schema", str(schema), "--input", str(docs), "--output", str(tmp_path / "out.jsonl")]


def test_extract_reports_every_document_and_resumes(job):
    tmp_path, args = job
    out_path = tmp_path / "out.jsonl"
    run, summary = run_extract(tmp_path, *args)
    items = read_lines(out_path)
    by_id = {item["id"]: item for item in items}
    assert len(by_id) == len(items) == 8, "one line per document"
    assert set(by_id) == {"p1", "p2", "p3", "p4", "line-3", "no-text", "line-7", "huge"}
    assert "not JSON" in by_id["line-3"]["error"]
    assert "'text'" in by_id["no-text"]["error"]
    assert "repeats the id 'p1'" in by_id["line-7"]["error"]
    assert "maximum context length" in by_id["huge"]["error"]
    ok = [i for i in items if i["status"] == "ok"]
    for item in ok:
        jsonschema.validate(item["data"], SCHEMA)
        assert item["finish_reason"] == "stop" and item["usage"]["completion_tokens"] > 0
    for item in items:
        if item["status"] != "ok":
            assert item["error"] and item["data"] is None
    assert summary["documents"] == 8 and summary["done"] + summary["failed"] == 8 and summary["done"] == len(ok)
    assert summary["invalid"] == 0 and summary["validity_rate"] == 1.0
    assert summary["cached_tokens"] > 0  # the shared instruction and schema came from the prefix cache
    assert "documents 8" in run.stderr and "validity" in run.stderr

    # An interrupted job: its last two lines lost, and a line torn in the middle of its write.
    kept = out_path.read_text().splitlines(keepends=True)[:-2]
    out_path.write_text("".join(kept) + '{"id": "p9", "status": "o')
    _, summary = run_extract(tmp_path, *args)
    again = read_lines(out_path)
    assert summary["skipped"] == 6 and summary["done"] + summary["failed"] == 2
    assert sorted(i["id"] for i in again) == sorted(by_id), "each document once, the torn line gone"

    # Nothing left to do: a re-run changes nothing.
    before = out_path.read_text()
    _, summary = run_extract(tmp_path, *args)
    assert summary["skipped"] == 8 and summary["done"] == summary["failed"] == 0
    assert out_path.read_text() == before

    # --retry-failed runs the failed documents again and keeps the successes.
    _, summary = run_extract(tmp_path, *args, "--retry-failed")
    final = read_lines(out_path)
    assert sorted(i["id"] for i in final) == sorted(by_id)
    succeeded = {i["id"] for i in again if i["status"] == "ok"}
    assert succeeded <= {i["id"] for i in final if i["status"] == "ok"}
    assert summary["skipped"] == len(succeeded) and summary["done"] + summary["failed"] == 8 - len(succeeded)


def test_extract_reads_a_folder_of_text_files(tmp_path):
    folder = os.path.join(ROOT, "schemas", "examples", "tickets_txt")
    out_path = tmp_path / "tickets.jsonl"
    schema = os.path.join(ROOT, "schemas", "support_ticket.json")
    template = tmp_path / "prompt.jinja"
    template.write_text("Support email from the file {{ doc.path }} (id {{ id }}):\n{{ text }}\n")
    args = ["--schema", schema, "--input", folder, "--output", str(out_path), "--prompt-template", str(template)]
    _, summary = run_extract(tmp_path, *args, context=2048)
    items = read_lines(out_path)
    assert sorted(i["id"] for i in items) == sorted(n for n in os.listdir(folder) if n.endswith(".txt"))
    assert summary["documents"] == len(items) and summary["invalid"] == 0
    for item in items:  # each ran (validated, or cut at max_tokens 48), none refused
        assert item["status"] == "ok" or item["finish_reason"] == "length", item


def test_extract_refuses_a_bad_schema_before_loading_the_model(tmp_path):
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "no-such-type"}}}')
    docs = tmp_path / "d.jsonl"
    docs.write_text('{"id": 1, "text": "x"}\n')
    cmd = [sys.executable, "-m", "gramserve", "extract", "--schema", str(schema), "--input", str(docs)]
    run = subprocess.run([*cmd, "--output", str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "gramserve extract:" in run.stderr and "no-such-type" in run.stderr

    # settings that would fail every document are usage errors too (a re-run would skip those documents as done)
    good = tmp_path / "good.json"
    good.write_text('{"type": "object", "properties": {"a": {"type": "string"}}}')
    for flag, value in (("--max-tokens", "0"), ("--temperature", "-1"), ("--limit", "-1")):
        cmd = [sys.executable, "-m", "gramserve", "extract", "--schema", str(good), "--input", str(docs), flag, value]
        run = subprocess.run([*cmd, "--output", str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and flag in run.stderr, (flag, run.stderr)


def test_extract_never_deletes_lines_it_did_not_write(tmp_path):
    """A new user's finding: resuming into an --output with lines that are not a job's records (notes, another
    file, the input itself) silently dropped them. Those, a folder as --output and the input as --output are now
    usage errors before the model loads, and the file is left as it was."""
    schema = os.path.join(ROOT, "schemas", "support_ticket.json")
    docs = tmp_path / "d.jsonl"
    docs.write_text('{"id": "x1", "text": "Ann, 30, Rome."}\n{"id": "x2", "text": "Ben, 40, Oslo."}\n')
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "x1", "status": "ok", "data": {}}\ngarbage line\n{"note": "my notes"}\n')
    cmd = [sys.executable, "-m", "gramserve", "extract", "--schema", schema, "--input", str(docs), "--output"]
    for output, fragment in ((mine, "line 2 is not a line of an extraction output"), (docs, "is the input file"),
                             (tmp_path, "is a folder")):  # fmt: skip
        before = output.read_text() if output.is_file() else None
        run = subprocess.run([*cmd, str(output)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and fragment in run.stderr and "Traceback" not in run.stderr, run.stderr[-1500:]
        assert before is None or output.read_text() == before


def test_an_interrupted_extract_says_how_to_go_on(tmp_path):
    """SIGTERM (handled as Ctrl-C) mid-job: exit 143 (130 for Ctrl-C) with a line saying the same command resumes,
    no traceback (Ctrl-C printed asyncio's KeyboardInterrupt traceback; SIGTERM exited without a word)."""
    schema, docs, out = tmp_path / "person.json", tmp_path / "docs.jsonl", tmp_path / "out.jsonl"
    schema.write_text(json.dumps(SCHEMA))
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": GOOD[i % 4][1]}) + "\n" for i in range(400)))
    cmd = [sys.executable, "-m", "gramserve", "extract", "--skip-warmup", "--no-progress", "--max-tokens", "48"]
    cmd += ["--schema", str(schema), "--input", str(docs), "--output", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143 and "the same command again goes on from there" in err, err[-3000:]
    assert "Traceback" not in err and 2 <= len(out.read_text().splitlines()) < 400
