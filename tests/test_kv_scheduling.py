"""KV memory and scheduling with the real model: prefix cache, chunked prefill, retraction, priority, queue limit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import time

import httpx
import pytest
from conftest import wait_pool_whole

from gramserve.config import ServerArgs
from gramserve.messages import TokenizedGenerateReq
from gramserve.sampling.params import SamplingParams
from gramserve.scheduler.scheduler import Scheduler
from gramserve.scheduler.stats import StepPhases
from gramserve.server.settings import in_process_config


def _workload() -> list[list[int]]:
    """Prompts sharing prefixes of various lengths, including ones that end mid-node."""
    system = list(range(1000, 1120))
    prompts = []
    for i in range(10):
        shared = system[: 30 + 9 * i]  # every prefix length differs, so matches end inside tree edges
        prompts.append(shared + [3000 + i, 3100 + i, 3200 + i])
    prompts.append(system + [42])  # the longest shared prefix
    prompts.append([7, 8, 9])  # shares nothing
    return prompts


def _run(tokenizer, prompts, waves: int = 2, params=None, **kw) -> tuple[dict, dict]:
    """Run the prompts through a scheduler in `waves` (later waves can hit the cache); return outputs + info."""
    sched = Scheduler(in_process_config(ServerArgs(**kw)), tokenizer)
    outs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    per_wave = -(-len(prompts) // waves)
    for w in range(waves):
        for i, p in enumerate(prompts[w * per_wave : (w + 1) * per_wave]):
            sp = params(i) if params else SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
            sched.add_request(TokenizedGenerateReq(f"r{w}-{i}", p, sp))
        while sched.has_work:
            out = sched.step()
            for rid, ids, fin in zip(out.rids, out.new_token_ids, out.finished) if out else ():
                assert rid not in finished, f"{rid} got output after it finished"
                outs.setdefault(rid, []).extend(ids)
                if fin is not None:
                    finished[rid] = fin.type
    assert set(finished) == set(outs), "every request finishes exactly once"
    return outs, sched.server_info()


def _assert_whole(info: dict) -> None:
    pool = info["kv_pool"]
    assert pool["used_slots"] == 0, pool
    assert pool["free_slots"] + pool["cached_slots"] == pool["total_slots"], pool
    assert pool["free_request_rows"] == pool["max_running_requests"]


def test_prefix_cache_chunking_and_small_pool_keep_outputs(tokenizer):
    prompts = _workload()
    reference, info = _run(tokenizer, prompts, kv_cache_memory_gb=0.3, disable_radix_cache=True)
    _assert_whole(info)
    assert all(len(v) == 10 for v in reference.values())

    cached, info = _run(tokenizer, prompts, kv_cache_memory_gb=0.3)
    assert cached == reference
    assert info["stats"]["cached_prompt_tokens"] > 100, info["stats"]
    _assert_whole(info)

    chunked, info = _run(tokenizer, prompts, kv_cache_memory_gb=0.3, chunked_prefill_size=16)
    assert chunked == reference
    _assert_whole(info)

    # A pool that cannot hold every request at once: requests wait or are retracted, never fail.
    tiny, info = _run(
        tokenizer,
        prompts,
        waves=1,
        kv_cache_memory_gb=0.0075,
        context_length=256,
        kv_reserve_ratio=0.0,
        chunked_prefill_size=64,
    )
    assert info["kv_pool"]["total_slots"] < sum(len(p) + 10 for p in prompts)
    assert info["stats"]["retractions"] > 0
    assert {k.split("-")[1]: v for k, v in tiny.items()} == {
        str(i): reference[f"r{i // 6}-{i % 6}"] for i in range(len(prompts))
    }
    _assert_whole(info)


def test_overlap_schedule_gives_the_same_tokens(tokenizer):
    """The overlap loop (GPU default) run on the CPU: same tokens, same finishes, KV pool whole afterwards."""
    prompts = _workload()

    def varied(i):  # requests finishing at different steps, by length, EOS and stop token
        return SamplingParams(
            max_new_tokens=1 + i % 7, temperature=0, ignore_eos=i % 3 == 0, stop_token_ids=[28] if i % 4 == 1 else []
        )

    for kw in (
        {},
        {"chunked_prefill_size": 16},
        {"params": varied},
        {
            "waves": 1,
            "kv_cache_memory_gb": 0.0075,
            "context_length": 256,
            "kv_reserve_ratio": 0.0,
            "chunked_prefill_size": 64,
        },
    ):
        kw = {"kv_cache_memory_gb": 0.3, **kw}
        plain, _ = _run(tokenizer, prompts, overlap_schedule="off", **kw)
        overlap, info = _run(tokenizer, prompts, overlap_schedule="on", **kw)
        assert overlap == plain, kw
        _assert_whole(info)
        if "waves" in kw:
            assert info["stats"]["retractions"] > 0


def test_fcfs_policy_and_priority(tokenizer):
    sched = Scheduler(
        in_process_config(ServerArgs(kv_cache_memory_gb=0.3, schedule_policy="fcfs", max_running_requests=1)), tokenizer
    )
    order = []
    for rid, prio in (("low", 5), ("high", -1), ("mid", 0)):
        sched.add_request(
            TokenizedGenerateReq(rid, [10, 11, 12], SamplingParams(max_new_tokens=2, temperature=0), priority=prio)
        )
    while sched.has_work:
        out = sched.step()
        order += [rid for rid, fin in zip(out.rids, out.finished) if fin is not None]
    assert order == ["high", "mid", "low"]


def run_arrivals(sched: Scheduler, arrivals: dict[int, list[TokenizedGenerateReq]]):
    """Step a scheduler, adding requests at the steps given; returns (first output step, tokens) per rid, and the
    scheduler's info at the end."""
    first_step: dict[str, int] = {}
    outs: dict[str, list[int]] = {}
    step = 0
    while sched.has_work or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        out = sched.step()
        step += 1
        for rid, ids in zip(out.rids, out.new_token_ids) if out else ():
            first_step.setdefault(rid, step)
            outs.setdefault(rid, []).extend(ids)
    return first_step, outs, sched.server_info()


def short_prompts_beside_a_long_one(make_scheduler, adapters: dict[str, int]):
    """A 400-token prompt prefilled in chunks of 64 from step 0; short prompts arrive at steps 2 and 4. Checks that
    every request gives the tokens it gives alone; returns the first output step per rid."""
    prompts = {"long": list(range(1000, 1400)), **{f"short{i}": [20 + i, 21, 22, 23, 24] for i in range(3)}}
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    def req(rid):
        return TokenizedGenerateReq(rid, prompts[rid], params, lora_id=adapters.get(rid, 0))

    alone = {rid: run_arrivals(make_scheduler(), {0: [req(rid)]})[1][rid] for rid in prompts}
    first, together, info = run_arrivals(
        make_scheduler(), {0: [req("long")], 2: [req("short0"), req("short1")], 4: [req("short2")]}
    )
    assert together == alone
    _assert_whole(info)
    return first


def test_short_prompts_go_in_beside_a_long_prompts_chunks(tokenizer):
    """A short prompt that arrives while a long one is prefilled chunk by chunk starts decoding at once (it used to
    wait for the whole long prefill: 42 s for 3,000 tokens on this CPU)."""
    args = ServerArgs(kv_cache_memory_gb=0.3, chunked_prefill_size=64)
    first = short_prompts_beside_a_long_one(lambda: Scheduler(in_process_config(args), tokenizer), {})
    assert max(first[rid] for rid in ("short0", "short1", "short2")) < first["long"], first
    assert first["short0"] <= 4 and first["short2"] <= 6, first  # the step after they arrived, or the next

    # The request between two of its chunks counts as running in /get_server_info (it was in no count).
    sched = Scheduler(in_process_config(args), tokenizer)
    sched.add_request(TokenizedGenerateReq("long", list(range(1000, 1400)), SamplingParams(max_new_tokens=2)))
    sched.step()
    info = sched.server_info()
    assert (info["num_running"], info["num_waiting"]) == (1, 0), info


def test_decode_cadence_counts_decode_only_steps(tokenizer):
    """`step_phases_ms.decode_steps` (what bench_schema_suite.py compares between constrained and free runs): the
    wall time from each decode-only step to the next step, with its rows; prefill steps and idle waits are not in
    it."""
    prompts = _workload()
    _, info = _run(tokenizer, prompts, waves=1)
    decode = info["step_phases_ms"]["decode_steps"]
    # Each request's first token comes from its prefill step, the other 9 from decode steps; the last decode step
    # counts only once a next step starts, which the loop above never runs.
    assert len(prompts) * 9 - len(prompts) <= decode["rows"] <= len(prompts) * 9, decode
    assert 0 < decode["steps"] < info["step_phases_ms"]["steps"] and decode["ms"] > 0, decode
    assert sum(n for n, _, _ in decode["by_rows"].values()) == decode["steps"], decode
    assert all(rows <= n * int(size) for size, (n, _, rows) in decode["by_rows"].items()), decode

    phases = StepPhases()
    phases.start()
    phases.decoding(rows=4)
    time.sleep(0.02)
    phases.start()  # a prefill step: not counted once the next one starts
    time.sleep(0.01)
    phases.start()
    phases.decoding(rows=3)
    phases.idle()  # the loop blocked for messages
    time.sleep(0.02)
    phases.start()
    decode = phases.snapshot()["decode_steps"]
    assert (decode["steps"], decode["rows"]) == (1, 4) and 20 <= decode["ms"] < 200, decode
    assert list(decode["by_rows"]) == ["4"] and decode["by_rows"]["4"][0] == 1, decode


def test_http_cached_tokens_flush_and_retraction(tight_server):
    url = tight_server.base_url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    system = "You are a meticulous assistant. " * 12
    body = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}],
    }
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    second = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 50
    assert httpx.post(url + "/flush_cache").status_code == 200
    third = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # More work than the ~430-slot pool holds at once: all finish, identical to running alone.
    prompts = [f"Write about the number {i}. " * 6 for i in range(6)]

    def one(p):
        return httpx.post(
            url + "/v1/completions",
            timeout=300,
            json={"model": model, "prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": True},
        ).json()

    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(one, prompts))
    info = httpx.get(url + "/get_server_info").json()
    alone = [one(p) for p in prompts]
    assert [t["choices"][0]["text"] for t in together] == [a["choices"][0]["text"] for a in alone]
    assert info["stats"]["retractions"] > 0, info["stats"]
    assert wait_pool_whole(url)["used_slots"] == 0


def test_http_queue_limit_is_503(tight_server):
    url = tight_server.base_url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            reqs = [
                client.post(
                    url + "/v1/completions",
                    json={"model": model, "prompt": f"Item {i}", "max_tokens": 32, "ignore_eos": True},
                )
                for i in range(30)
            ]
            return await asyncio.gather(*reqs)

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers.get("retry-after") and "queue" in rejected.json()["error"]["message"]
    assert wait_pool_whole(url)["used_slots"] == 0


def test_mixed_decode_gives_the_same_tokens(tokenizer):
    """Running requests that decode inside prefill steps (--mixed-decode, the CPU default) get the same greedy
    tokens as with separate decode steps, whatever the chunking and memory pressure, in the plain loop and under the
    overlap schedule (where a rider's input token is still on the device), and the pool ends whole."""
    prompts = _workload()
    # Small chunks: the first prompts decode while later ones are still being prefilled.
    for kw in (
        {"waves": 1, "chunked_prefill_size": 16},
        {"waves": 2, "chunked_prefill_size": 64},
        {"waves": 1, "kv_cache_memory_gb": 0.0075, "context_length": 256, "kv_reserve_ratio": 0.0,
         "chunked_prefill_size": 64},
    ):  # fmt: skip
        kw = {"kv_cache_memory_gb": 0.3, **kw}
        separate, _ = _run(tokenizer, prompts, mixed_decode="off", **kw)
        for overlap in ("off", "on"):
            mixed, info = _run(tokenizer, prompts, mixed_decode="on", overlap_schedule=overlap, **kw)
            assert mixed == separate, (kw, overlap)
            assert info["stats"]["mixed_decode_rows"] > 0, info["stats"]
            _assert_whole(info)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_max_consecutive_prefills_bounds_the_stall_of_running_streams(tokenizer, overlap):
    """A request decodes while a long prompt (6 chunks of 16 tokens) and two short ones arrive. With a limit of N,
    at most N prefill steps run between two decode steps; with 0 the prompts are prefilled back to back, as SGLang.
    The tokens are the same whatever the limit, in the plain loop and under the overlap schedule (CUDA's
    default)."""
    args = ServerArgs(
        device="cpu",
        chunked_prefill_size=16,
        max_consecutive_prefills=1,
        overlap_schedule=overlap,
        mixed_decode="off",  # decode rows riding in prefill steps would not stall (test_mixed_decode...)
        kv_cache_memory_gb=0.05,
        context_length=256,
    )
    sched = Scheduler(in_process_config(args), tokenizer)
    assert sched.max_consecutive_prefills == 1
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = {
        "running": range(500, 510),
        "long": range(600, 696),
        "short-a": range(700, 710),
        "short-b": range(800, 805),
    }
    runs = {}
    for limit in (1, 2, 0):
        sched.max_consecutive_prefills = limit
        assert sched.flush_cache()["ok"]  # every run prefills the same prompts from scratch
        sched.add_request(TokenizedGenerateReq(f"{limit}-running", list(prompts["running"]), params))
        kinds, outs = [], {}
        while sched.has_work:
            if len(kinds) == 2:  # "running" decodes by now
                for name in ("long", "short-a", "short-b"):
                    sched.add_request(TokenizedGenerateReq(f"{limit}-{name}", list(prompts[name]), params))
            out = sched.step()
            kinds.append("P" if sched._last_was_prefill else "D")
            for rid, ids in zip(out.rids, out.new_token_ids) if out else ():
                outs.setdefault(rid.split("-", 1)[1], []).extend(ids)
        assert sorted(outs) == sorted(prompts) and all(len(v) == 12 for v in outs.values())
        kinds = "".join(kinds)
        # "running" alone, then 96 + 10 + 5 prompt tokens in chunks of 16: 6 chunks of "long", then both short ones
        assert kinds.count("P") == 1 + 7, (limit, kinds)
        assert max(len(run) for run in kinds.split("D")) == (7 if limit == 0 else limit), (limit, kinds)
        runs[limit] = outs
    assert runs[1] == runs[2] == runs[0]


def test_prefill_wait_steps_let_prompts_arriving_one_by_one_share_a_prefill_step(tokenizer):
    """--max-prefill-wait-steps: while 8 requests decode, a prompt that arrives waits until that many decode steps
    have run since the last prefill step (prompts arriving one by one then share prefill steps), but goes in at once
    when the prompts waiting are a quarter of the running requests. Same tokens whatever the wait."""
    args = ServerArgs(device="cpu", mixed_decode="off", kv_cache_memory_gb=0.05, context_length=256)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)

    def run(wait: int, late: int) -> tuple[str, dict[str, list[int]]]:
        sched = Scheduler(in_process_config(args), tokenizer)
        sched.max_prefill_wait_steps = wait
        for i in range(8):
            sched.add_request(TokenizedGenerateReq(f"r{i}", list(range(500 + 10 * i, 507 + 10 * i)), params))
        kinds, outs = [], {}
        while sched.has_work:
            if len(kinds) == 2:  # the 8 decode by now; the last prefill step was the first step
                for j in range(late):
                    sched.add_request(TokenizedGenerateReq(f"late{j}", list(range(900 + 10 * j, 905 + 10 * j)), params))
            out = sched.step()
            kinds.append("P" if sched._last_was_prefill else "D")
            for rid, ids in zip(out.rids, out.new_token_ids) if out else ():
                outs.setdefault(rid, []).extend(ids)
        assert all(len(v) == 8 for v in outs.values()) and len(outs) == 8 + late
        return "".join(kinds), outs

    kinds, plain = run(0, 1)
    assert kinds.startswith("PDP"), kinds  # at once
    kinds, waited = run(3, 1)
    assert kinds.startswith("PDDDP"), kinds  # once 3 decode steps ran after the last prefill step (2 after it came)
    assert waited == plain
    kinds, _ = run(3, 2)  # 2 waiting for 8 running: a quarter, in at once
    assert kinds.startswith("PDP"), kinds


def test_a_request_may_not_grow_past_the_kv_pool(tokenizer):
    """A KV pool smaller than the context length (a large shape on a CPU): the context becomes what the pool holds,
    so a request alone cannot outgrow it. Before, its step found no free slot and failed every request in flight
    (OutOfSlotsError: "internal error while running the batch")."""
    args = ServerArgs(
        model_path=str(pathlib.Path(__file__).parent / "data" / "tiny_llama.json"),
        load_format="dummy",
        kv_cache_memory_gb=0.0005,
        context_length=2048,
    )
    sched = Scheduler(in_process_config(args), tokenizer)
    assert sched.context_length == sched.allocator.size < 2048
    long = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)
    sched.add_request(TokenizedGenerateReq("long", [5] * 10, long))
    sched.add_request(TokenizedGenerateReq("short", [6] * 10, SamplingParams(max_new_tokens=20, temperature=0)))
    counts, finished = {}, {}
    while sched.has_work:
        out = sched.step()
        for rid, ids, fin in zip(out.rids, out.new_token_ids, out.finished) if out else ():
            counts[rid] = counts.get(rid, 0) + len(ids)
            if fin is not None:
                finished[rid] = fin.type
    assert finished == {"long": "length", "short": finished["short"]} and finished["short"] in ("stop", "length")
    assert counts["long"] == sched.context_length - 10
    _assert_whole(sched.server_info())
