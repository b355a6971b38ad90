"""Valid by construction, checked adversarially: random weights at temperature 1.0 walk the branches a grammar allows.

A server runs a tiny Llama shape with random weights (``tests/data/tiny_llama.json``, the default tokenizer), whose
near-flat logits make sampling a random walk over the tokens each mask allows. Over a seeded sample of corpus schemas
(``GRAMSERVE_FUZZ_SEED`` picks the sample, ``GRAMSERVE_FUZZ_SCHEMAS`` its size) and hand-written schemas for each
hard keyword class, every request must end in a 200 or a 400 (never a 5xx), every output that finished with
``stop`` must validate, and the KV pool must come back whole. The server runs with ``--grammar-check-retries 0``, so
every failed last check shows as ``invalid_output``: allowed only for schemas served relaxed (``llguidance:relaxed``,
grammar/schema_relax.py), never for one a backend enforces exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import httpx
import pytest
from conftest import start_server, wait_pool_whole

from tests.grammar_eval import instance_error

DATA = Path(__file__).parent / "data"
CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpora" / "jsonschemabench-dev"
SEED = int(os.environ.get("GRAMSERVE_FUZZ_SEED", "0"))
N_CORPUS = int(os.environ.get("GRAMSERVE_FUZZ_SCHEMAS", "60"))
MAX_TOKENS = 160
CONCURRENCY = 16

# One or more per keyword class that backends treat differently (see docs/structured-outputs.md).
HARD_SCHEMAS: dict[str, dict] = {
    "not_type": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]},
    "not_required": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"not": {}}},
        "not": {"required": ["a", "b"]},
    },
    "one_of_disjoint": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    "one_of_overlap": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "all_of_enums": {"type": "integer", "allOf": [{"enum": [1, 2, 8]}, {"enum": [8, 9]}]},
    "all_of_array_enums": {"type": "array", "allOf": [{"enum": [[1], [5], [1, 5]]}, {"enum": [[5], [1, 5]]}]},
    "pattern_pairs_min_length": {"type": "string", "pattern": "^([a-z][0-9])+$", "minLength": 12},
    "remote_ref": {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}, "required": ["a"]},
    "all_of_required": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    },
    "if_then_else": {
        "type": "object",
        "properties": {"c": {"enum": ["x", "y"]}, "d": {"type": "integer"}},
        "required": ["c"],
        "if": {"properties": {"c": {"const": "x"}}},
        "then": {"required": ["d"]},
    },
    "dependencies": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
    },
    "unique_items": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3},
    "pattern_escapes": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^\\d{3}-[A-Z]{2}\\.\\w$"},
            "path": {"type": "string", "pattern": "^[a-z]+(\\\\[a-z]+){0,2}$"},
        },
        "required": ["code", "path"],
    },
    "pattern_with_lengths": {"type": "string", "pattern": "^[a-z0-9]+$", "minLength": 3, "maxLength": 6},
    "string_bounds": {"type": "string", "minLength": 2, "maxLength": 4},
    "array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -3, "maximum": 3},
        "minItems": 2,
        "maxItems": 3,
    },
    "object_bounds": {
        "type": "object",
        "additionalProperties": {"type": "boolean"},
        "minProperties": 1,
        "maxProperties": 2,
    },
    "number_bounds": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5, "multipleOf": 0.25},
    "narrow_exclusive_range": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001},
    "times": {"type": "array", "items": {"type": "string", "format": "time"}, "minItems": 3, "maxItems": 3},
    "optional_group_pattern": {"type": "string", "pattern": "^a(b\\d+)?Z$"},
    "formats": {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "mail": {"type": "string", "format": "email"},
        },
        "required": ["when", "day", "id", "mail"],
    },
    "recursive_ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "large_enum": {"enum": [f"value-{i:04d}" for i in range(500)]},
    "nullable_union": {"type": ["integer", "null", "boolean"]},
    # served relaxed: the grammar without the keyword, the last check for it
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 2}, "maxItems": 4},
    "property_names": {"type": "object", "propertyNames": {"maxLength": 3}, "maxProperties": 2},
    "unevaluated": {
        "type": "object",
        "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}],
        "unevaluatedProperties": False,
    },
    "not_enum": {"type": "string", "enum": ["a", "b", "c"], "not": {"enum": ["a"]}},
    "lookahead": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"},
}


def _sample() -> list[tuple[str, dict]]:
    files = sorted(CORPUS.glob("*.json")) if CORPUS.is_dir() else []
    random.Random(SEED).shuffle(files)
    out = [(f.stem, json.loads(f.read_text())["schema"]) for f in files[:N_CORPUS]]
    return out + sorted(HARD_SCHEMAS.items())


@pytest.fixture(scope="module")
def random_server(tmp_path_factory):
    srv = start_server(
        str(tmp_path_factory.mktemp("fuzz")),
        "--model-path",
        str(DATA / "tiny_llama.json"),
        "--load-format",
        "dummy",
        "--grammar-check-retries",
        "0",
    )
    yield srv
    srv.stop()


def test_random_walks_over_schemas_end_valid(random_server):
    base = random_server.base_url
    sample = _sample()

    async def one(http: httpx.AsyncClient, sem: asyncio.Semaphore, model: str, i: int, name: str, schema: dict):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"JSON for {name}"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "seed": SEED * 100_000 + i,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        }
        async with sem:
            r = await http.post(base + "/v1/chat/completions", json=body)
        if r.status_code != 200:
            return name, f"http {r.status_code}", r.text[:300], None
        choice = r.json()["choices"][0]
        return name, choice["finish_reason"], choice["message"]["content"] or "", r.json()["grammar_backend"]

    async def run():
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=900) as http:
            model = (await http.get(base + "/v1/models")).json()["data"][0]["id"]
            return await asyncio.gather(*(one(http, sem, model, i, n, s) for i, (n, s) in enumerate(sample)))

    results = asyncio.run(run())
    schemas = dict(sample)
    counts: dict[str, int] = {}
    invalid, unexpected = [], []
    relaxed = {name for name, _, _, backend in results if backend and backend.endswith(":relaxed")}
    for name, finish, content, backend in results:
        counts[finish] = counts.get(finish, 0) + 1
        if finish == "invalid_output" and name in relaxed:
            assert instance_error(schemas[name], content), (name, content)  # the check fired for a reason
        elif finish not in ("stop", "length", "http 400"):  # a 5xx, another error, or the check fired on an exact one
            unexpected.append((name, finish, backend, content))
        elif finish == "stop":
            why = instance_error(schemas[name], content)
            if why:
                invalid.append((name, why, content[:300]))
    print(f"fuzz seed {SEED}: {len(results)} schemas, {counts}, served relaxed: {sorted(relaxed)}")
    assert not unexpected, unexpected
    assert not invalid, invalid
    assert counts.get("stop", 0) >= 0.15 * len(results), counts  # enough finished outputs to mean something
    assert {"one_of_overlap", "if_then_else", "dependencies", "unique_items", "contains"} <= relaxed, relaxed
    info = httpx.get(base + "/get_server_info", timeout=30).json()
    assert info["output_checks"]["invalid"] == counts.get("invalid_output", 0), info["output_checks"]
    assert wait_pool_whole(base)["used_slots"] == 0
