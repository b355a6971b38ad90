"""Hostile input against the real server: every bad value is a 4xx with OpenAI's error JSON, no request takes the
server down or fails another's, and nothing stalls the event loop (issue 21's defects, one regression test each)."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import start_server, wait_pool_whole

from gramserve.parsers.tool_calls._schema import INLINE_BUDGET, inline_refs

CHAT = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 2, **fields}


# (path, JSON body, status, the error's param or None)
HOSTILE = [
    ("/v1/chat/completions", _chat(seed=2**64), 400, "seed"),
    ("/v1/chat/completions", _chat(seed=-(2**63) - 1), 400, "seed"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "sampling_seed": 10**30}}, 400, None),
    ("/v1/chat/completions", _chat(top_k=1180591620717411303424), 400, "top_k"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": -5}, 400, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}, 400, "top_logprobs_num"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "abc"}}, 400, "sampling_params"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": 5}}, 400, "sampling_params"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"abc": 1}}}, 400, "logit_bias"),
    ("/v1/chat/completions", _chat(temperature=1e300), 400, "temperature"),
    ("/v1/chat/completions", _chat(temperature=1e300, response_format={"type": "json_object"}), 400, "temperature"),
    ("/v1/chat/completions", _chat(priority=10**30), 400, "priority"),
    ("/v1/completions", {"prompt": [True, 5], "max_tokens": 2}, 400, "prompt"),  # was token ids 1 and 5
    ("/generate", {"input_ids": [1.5, 2]}, 400, "input_ids"),
    ("/v1/chat/completions", _chat(stop=["x" * 5000]), 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", _chat(chat_template_kwargs={"chat_template": "{{ 'x' }}"}), 400, "chat_template_kwargs"),
    ("/abort_request", {"rid": ["a"]}, 400, "rid"),
    ("/v1/chat/completions", _chat(n=10**30), 400, "n"),
]

RAW = [  # bodies that are not JSON a client library would send
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "surrogate"),
    ("/v1/chat/completions", b"[" * 100_000, "nests too deeply"),
    ("/abort_request", b"", "not valid JSON"),
]


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def _healthy(base_url: str) -> bool:
    return (
        httpx.get(base_url + "/health", timeout=10).status_code == 200 == httpx.head(base_url + "/health").status_code
    )


@pytest.mark.parametrize("path,body,status,param", HOSTILE, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(HOSTILE)])
def test_hostile_values_are_refused_and_the_server_lives(base_url, model_name, path, body, status, param):
    r = httpx.post(base_url + path, json={"model": model_name, **body}, timeout=60)
    _assert_openai_error(r, status, param)
    assert _healthy(base_url)


@pytest.mark.parametrize("path,raw,fragment", RAW, ids=[f for *_, f in RAW])
def test_malformed_bodies_are_400(base_url, path, raw, fragment):
    r = httpx.post(base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert fragment in _assert_openai_error(r, 400)["message"]
    assert _healthy(base_url)


def test_a_bad_request_fails_alone(base_url, model_name):
    """Bad requests sent while another streams: the stream runs to its end, not to an abort."""
    body = {"text": "Count:", "stream": True, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        for path, bad, status, param in HOSTILE[:8]:
            _assert_openai_error(httpx.post(base_url + path, json={"model": model_name, **bad}, timeout=60), status)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    meta = events[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 40, meta


def test_new_role_names_are_served(client, model_name):
    resp = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "developer", "content": "Answer briefly."}, *CHAT],
        max_tokens=3,
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_405_names_the_allowed_methods(base_url):
    r = httpx.get(base_url + "/v1/chat/completions")
    _assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"


def test_no_local_paths_or_ipc_names_are_shown(base_url):
    card = httpx.get(base_url + "/v1/models").json()["data"][0]
    assert "/" not in (card["root"] or "")
    info = httpx.get(base_url + "/get_server_info").json()
    assert not {"ipc_dir", "grammar_shm", "tokenizer_dir"} & set(info["launch"])
    assert "/" not in (info["runner"]["model_path"] or "")
    assert "gramserve-ipc" not in json.dumps(info)


class _HealthWatch:
    """Pings /health while a request runs; `worst` is the slowest answer (an event-loop stall shows here)."""

    def __init__(self, base_url: str):
        self.base_url, self.worst, self._stop = base_url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            httpx.get(self.base_url + "/health", timeout=60)
            self.worst = max(self.worst, time.monotonic() - t)
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _ref_bomb(levels: int) -> dict:
    """Definitions d0..dN, each holding two $refs to the next: 2^N nodes once inlined, from a 2 KB schema."""
    defs = {}
    for i in range(levels):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": ref, "b": dict(ref)}}
    defs[f"d{levels}"] = {"type": "string"}
    return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def test_ref_inlining_stops_at_its_budget():
    bomb = _ref_bomb(21)
    t = time.monotonic()
    assert inline_refs(bomb) is bomb  # past the budget: the references stay, with their definitions
    assert time.monotonic() - t < 1.0
    small = _ref_bomb(4)  # 2^4 leaves: inlined
    out = inline_refs(small)
    assert "$defs" not in out and out["properties"]["x"]["properties"]["a"]["properties"]["b"]["type"] == "object"
    assert INLINE_BUDGET >= 1000


def test_nothing_stalls_the_event_loop(base_url, model_name):
    tool = {"type": "function", "function": {"name": "f", "parameters": _ref_bomb(21)}}
    with _HealthWatch(base_url) as watch:
        r = httpx.post(
            base_url + "/v1/chat/completions",
            json={"model": model_name, "messages": CHAT, "tools": [tool], "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code in (200, 400), r.text
        r = httpx.post(  # past --max-request-bytes: refused before it is read
            base_url + "/v1/chat/completions",
            json={"model": model_name, "messages": [{"role": "user", "content": "word " * 4_000_000}]},
            timeout=120,
        )
        _assert_openai_error(r, 413)
        r = httpx.post(  # under the byte limit, but more characters than the context can hold: never tokenized
            base_url + "/v1/chat/completions",
            json={"model": model_name, "messages": [{"role": "user", "content": "word " * 2_000_000}]},
            timeout=120,
        )
        assert "context length" in _assert_openai_error(r, 400, "messages")["message"]
        r = httpx.post(base_url + "/generate", json={"text": "word " * 2_000_000}, timeout=120)
        assert "context length" in _assert_openai_error(r, 400, "prompt")["message"]
    assert watch.worst < 2.0, f"/health took {watch.worst:.2f} s during the requests"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_an_n3_request_leaks_nothing(server, base_url, model_name, stream):
    body = {"model": model_name, "messages": CHAT, "n": 3, "max_tokens": 400, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=1.5) as c:
        if stream:
            with c.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 4:
                        break  # closing the response mid-stream: the client is gone
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post(base_url + "/v1/chat/completions", json=body)
    pool = wait_pool_whole(base_url)
    assert pool["used_slots"] == 0 and pool["free_request_rows"] == pool["max_running_requests"], pool
    assert "asynchronous generator is already running" not in server.log()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    srv = start_server(
        str(tmp_path_factory.mktemp("keyed")),
        *("--api-key", "sk-user", "--admin-api-key", "sk-admin", "--request-timeout", "4"),
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_api_keys(keyed_server):
    from openai import AuthenticationError, OpenAI

    url = keyed_server.base_url
    assert httpx.get(url + "/health").status_code == 200  # open: load balancers probe it
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-user"}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert _assert_openai_error(r, 401)["code"] == "invalid_api_key"
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url=url + "/v1", api_key="sk-user", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
    assert resp.choices[0].message.content is not None
    # Admin routes take the admin key only.
    user, admin = {"Authorization": "Bearer sk-user"}, {"Authorization": "Bearer sk-admin"}
    _assert_openai_error(httpx.post(url + "/abort_request", json={"rid": "x"}, headers=user), 401)
    assert httpx.post(url + "/abort_request", json={"rid": "x"}, headers=admin).status_code == 200
    info = httpx.get(url + "/get_server_info", headers=user).json()
    assert info["server_args"]["api_key"] == "(set)" and "sk-" not in json.dumps(info)


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples in Prometheus text that have these labels (0 when none): every label value of the
    others (a family may hold several reasons)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def test_metrics_count_what_the_server_did(base_url, client, model_name):
    before = httpx.get(base_url + "/metrics").text
    first = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    # A stream the client leaves: its prompt was computed, and counts (it counted only for finished requests).
    body = {"model": model_name, "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as left:
        next(line for line in left.iter_lines() if '"content":"' in line and '"content":""' not in line)
    client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=3, response_format={"type": "json_object"}
    )
    r = httpx.post(base_url + "/v1/chat/completions", json={"model": model_name, **_chat(regex="(")}, timeout=120)
    assert r.status_code == 400  # a regex that does not compile: a refusal
    r = httpx.get(base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = r.text
    for name in (
        "gramserve:time_to_first_token_seconds_bucket",
        "gramserve:inter_token_latency_seconds_count",
        "gramserve:e2e_request_latency_seconds_sum",
        "gramserve:num_requests_running",
        "gramserve:kv_cache_usage_perc",
        "gramserve:prefix_cache_hits_total",
        "gramserve:grammar_compile_seconds_bucket",
        "gramserve:output_checks_total",
    ):
        assert name in after, name
    # one HELP and one TYPE line per family (Go's parser, promtool and most agents refuse a family given twice)
    for kind in ("# HELP ", "# TYPE "):
        families = [line.split()[2] for line in after.splitlines() if line.startswith(kind)]
        assert len(families) == len(set(families)), sorted(f for f in families if families.count(f) > 1)

    def grew(name: str, by: float, **labels: str) -> bool:
        return _metric(after, name, **labels) - _metric(before, name, **labels) >= by

    dashboard = (Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text()
    for name in set(re.findall(r"gramserve:[a-z0-9_]+", dashboard)):  # every series the dashboard plots exists
        assert re.search(rf"^{name}[{{ ]", after, re.M), name
    assert grew("gramserve:generation_tokens_total", 5)
    assert grew("gramserve:prompt_tokens_total", 3 * first.usage.prompt_tokens)
    assert grew("gramserve:request_success_total", 1, finished_reason="length")
    assert grew("gramserve:constrained_requests_total", 1, kind="json_object")
    assert grew("gramserve:grammar_refusals_total", 1)
    assert grew("gramserve:request_failure_total", 1, reason="invalid_request")


def test_metrics_are_open_unless_asked(keyed_server):
    assert httpx.get(keyed_server.base_url + "/metrics").status_code == 200


def test_request_ids_and_the_access_log(server, base_url, model_name):
    body = {"model": model_name, "messages": CHAT, "max_tokens": 2}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "client-id-7"}, timeout=60)
    assert r.headers["x-request-id"] == "client-id-7" and r.json()["id"] == "chatcmpl-client-id-7"
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.json()["id"] == "chatcmpl-" + r.headers["x-request-id"]
    r = httpx.post(base_url + "/v1/chat/completions", json={"messages": []}, headers={"X-Request-Id": "bad one!"})
    assert r.status_code == 400 and r.headers["x-request-id"] != "bad one!"  # not a sane id: a fresh one
    # The same id twice at once: both run (their engine requests get distinct ids).
    with ThreadPoolExecutor(2) as pool:
        codes = list(
            pool.map(
                lambda _: (
                    httpx.post(
                        base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "twice"}, timeout=60
                    ).status_code
                ),
                range(2),
            )
        )
    assert codes == [200, 200]
    time.sleep(0.2)
    assert re.search(r"client-id-7 POST /v1/chat/completions 200 [0-9.]+ ms", server.log())


def test_no_request_makes_the_server_fetch_a_ref(base_url, model_name, tmp_path):
    """$refs to a URL or a file, in response formats and in tools, with every backend: a 400, nothing fetched."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    local = tmp_path / "schema.json"
    local.write_text('{"type": "string"}')
    try:
        for ref in (f"http://127.0.0.1:{httpd.server_port}/schema.json", f"file://{local}", str(local)):
            schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
            for backend in ("auto", "xgrammar", "llguidance", "outlines"):
                rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                body = {"model": model_name, **_chat(response_format=rf, grammar_backend=backend)}
                r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
                _assert_openai_error(r, 400)
            tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
            body = {"model": model_name, **_chat(tools=[tool], tool_choice="required")}
            r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code in (200, 400), r.text
    finally:
        httpd.shutdown()
    assert hits == []


def test_a_client_leaving_while_its_grammar_compiles_leaks_nothing(base_url, model_name):
    """xgrammar takes seconds on this pattern: the client gives up after half a second."""
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^([a-z0-9]{5,50}-){20,40}$"}},
        "required": ["code"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}
    body = {"model": model_name, **_chat(response_format=rf, grammar_backend="xgrammar", max_tokens=8)}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.time() + 60
    while True:  # the compile ends (or times out) on its own; then nothing of the request is left
        info = httpx.get(base_url + "/get_server_info", timeout=10).json()
        pool = info["kv_pool"]
        done = info["num_grammar_compiling"] == 0 and info["grammar_live_requests"] == 0
        if done and pool["used_slots"] == 0 and pool["free_request_rows"] == pool["max_running_requests"]:
            break
        assert time.time() < deadline, info
        time.sleep(0.5)
    assert info["grammar_slots_in_use"] == 0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_flood_of_huge_prompts_is_refused_with_bounded_memory(server, base_url, model_name):
    """64 prompts of 3 MB at once (past what the context can hold, under the body limit): each a quick 400, and
    the main process's memory comes back near where it was."""
    before = _rss_mb(server.proc.pid)
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "word " * 600_000}]}).encode()

    def send(_):
        return httpx.post(
            base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=120
        ).status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(send, range(64)))
    assert codes == [400] * 64
    time.sleep(1)
    assert _rss_mb(server.proc.pid) - before < 400, (before, _rss_mb(server.proc.pid))
    assert _healthy(base_url)


def test_a_slow_reader_holds_only_its_own_request(base_url, model_name):
    """A stream read one event a second: other requests are served meanwhile; when it leaves, its KV comes back."""
    body = {"model": model_name, "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as slow:
        lines = slow.iter_lines()
        for _ in range(3):
            next(lines)
            time.sleep(1.0)
        t = time.monotonic()
        r = httpx.post(base_url + "/v1/chat/completions", json={"model": model_name, **_chat()}, timeout=60)
        assert r.status_code == 200 and time.monotonic() - t < 10
    pool = wait_pool_whole(base_url)
    assert pool["used_slots"] == 0 and pool["free_request_rows"] == pool["max_running_requests"], pool


def test_request_timeout_bounds_the_retries_of_a_checked_output_together(keyed_server, tokenizer):
    """Outputs that fail the last check are sampled again (--grammar-check-retries 2), and --request-timeout 4 counts
    from the request's start, not from each attempt's (a new user's finding: 12.6-17.6 s under an 8 s limit). Each
    attempt here runs about 0.9 of the limit, then stops inside a string (a stop token after min_tokens): invalid."""
    url, auth = keyed_server.base_url, {"Authorization": "Bearer sk-user"}
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1500}}, "required": ["s"]}
    letters = [i for i in range(len(tokenizer)) if re.fullmatch(r"[a-z]", tokenizer.decode([i]))]
    body = {
        "messages": [{"role": "user", "content": "Write a long story as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        "temperature": 1.0,
        "seed": 1,
        "stop_token_ids": letters,
    }

    def run(min_tokens: int, stream: bool = False) -> tuple[httpx.Response, float]:
        t = time.monotonic()
        payload = {**body, "min_tokens": min_tokens, "max_tokens": min_tokens + 400, "stream": stream}
        r = httpx.post(url + "/v1/chat/completions", json=payload, headers=auth, timeout=60)
        return r, time.monotonic() - t

    _, probe = run(80, stream=True)  # streamed: one attempt, no retries
    tokens = max(8, int(80 * 0.9 * 4 / probe))  # an attempt of about 0.9 x the 4 s limit (shorter or longer is fine)
    before = httpx.get(url + "/get_server_info", headers=auth).json()["output_checks"]["retried"]
    r, took = run(tokens)
    after = httpx.get(url + "/get_server_info", headers=auth).json()["output_checks"]["retried"]
    assert r.status_code in (200, 504), r.text
    if r.status_code == 200:
        assert r.json()["choices"][0]["finish_reason"] == "invalid_output"
    assert after - before <= 1  # a third attempt never started past the limit
    assert took < 4 + 4, took


def test_request_timeout(keyed_server):
    """--request-timeout 4: a long request ends with a 504 (a stream with a timeout error event) and is aborted."""
    url, auth = keyed_server.base_url, {"Authorization": "Bearer sk-user"}
    body = {"messages": CHAT, "max_tokens": 3000, "ignore_eos": True}
    t = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
    assert _assert_openai_error(r, 504)["type"] == "timeout" and time.monotonic() - t < 15
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=auth) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "timeout", events[-1]
    deadline = time.time() + 20
    while (pool := httpx.get(url + "/get_server_info", headers=auth).json()["kv_pool"])["used_slots"]:
        assert time.time() < deadline, pool  # the aborts reach the scheduler: its KV comes back
        time.sleep(0.2)
