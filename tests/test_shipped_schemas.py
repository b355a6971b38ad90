"""The extraction schemas shipped in ``schemas/``, their example inputs, and ``benchmarks/extraction_docs.py``.

Each schema must be a valid Draft 2020-12 schema, documented (title and description everywhere), closed
(``additionalProperties: false``), bounded (the default model is tiny and loops in unbounded strings and arrays),
and compile with xgrammar and llguidance exactly as written: not refused by the schema audit, nothing for
``schema_relax`` to drop. A hand-written extraction of the first example document of each schema must pass
jsonschema and both grammars, and a string one character past its ``maxLength`` must not. Only the default
tokenizer is needed, no model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark
from jsonschema import Draft202012Validator, FormatChecker

from gramserve.grammar.backends import GrammarCompileError, GrammarOptions, create_backend
from gramserve.grammar.compile_process import compile_grammar
from gramserve.grammar.schema_audit import unenforced
from gramserve.grammar.schema_relax import dropped_keywords
from gramserve.messages import GrammarRequest

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"
EXAMPLES = SCHEMAS / "examples"
NAMES = ("invoice", "person", "support_ticket", "paper", "product")
BACKENDS = ("xgrammar", "llguidance")
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def load(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def subschemas(schema: dict, at: str = ""):
    """(JSON pointer, schema) of the schema and of every property and array item schema inside it."""
    yield at or "/", schema
    for key, prop in schema.get("properties", {}).items():
        yield from subschemas(prop, f"{at}/properties/{key}")
    if isinstance(schema.get("items"), dict):
        yield from subschemas(schema["items"], f"{at}/items")


def types(schema: dict) -> set[str]:
    t = schema.get("type", [])
    return {t} if isinstance(t, str) else set(t)


def test_the_five_schemas_are_shipped():
    assert sorted(p.stem for p in SCHEMAS.glob("*.json")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_schema_is_valid_documented_closed_and_bounded(name):
    schema = load(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == DRAFT
    for at, node in subschemas(schema):
        assert node.get("title") and node.get("description"), f"{name}{at}: title and description"
        kinds = types(node)
        assert kinds, f"{name}{at}: no type"
        if "object" in kinds:
            assert node.get("additionalProperties") is False, f"{name}{at}: additionalProperties must be false"
            # Every key is required (null where the document says nothing): the output always has the same shape.
            assert node["required"] == list(node["properties"]), f"{name}{at}: required != properties"
        if "string" in kinds:
            assert node.keys() & {"maxLength", "format", "pattern", "enum"}, f"{name}{at}: unbounded string"
        if "array" in kinds:
            assert "maxItems" in node, f"{name}{at}: unbounded array"
        if kinds & {"integer", "number"}:
            assert "minimum" in node and "maximum" in node, f"{name}{at}: number without a range"


_backends: dict = {}


def backend(name: str, tokenizer):
    if name not in _backends:
        _backends[name] = create_backend(name, tokenizer, len(tokenizer), [tokenizer.eos_token_id], GrammarOptions())
    return _backends[name]


_compiled: dict = {}


def compiled(backend_name: str, name: str, tokenizer):
    """The schema compiled as the grammar service compiles it (audit, then the backend), not relaxed."""
    key = (backend_name, name)
    if key not in _compiled:
        b = backend(backend_name, tokenizer)
        _compiled[key] = compile_grammar(b, GrammarRequest("json_schema", (SCHEMAS / f"{name}.json").read_text()))
    return _compiled[key]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_schema_compiles_exactly(name, backend_name, tokenizer):
    text = (SCHEMAS / f"{name}.json").read_text()
    assert dropped_keywords(text) == [], "schema_relax would drop keywords: the schema is not enforced as written"
    assert unenforced(backend_name, text) == []
    try:
        compiled(backend_name, name, tokenizer)
    except GrammarCompileError as e:
        pytest.fail(f"{backend_name} refuses {name}.json: {e}")


# What a correct extraction of the first example document of each schema looks like.
EXPECTED = {
    "invoice": {
        "invoice_number": "INV-2024-0193",
        "issue_date": "2024-03-04",
        "due_date": "2024-04-03",
        "vendor_name": "Brightwater Web Consulting LLC",
        "customer_name": "Maple Ridge Dental Group",
        "currency": "USD",
        "line_items": [
            {"description": "Website redesign - fixed fee", "quantity": 1, "unit_price": 4800.0},
            {"description": "Hosting and SSL setup", "quantity": 1, "unit_price": 350.0},
            {"description": "Content writing (hours)", "quantity": 12, "unit_price": 85.0},
        ],
        "subtotal": 6170.0,
        "tax": 0,
        "total": 6170.0,
    },
    "person": {
        "name": "Amara Okonkwo-Reid",
        "email": "amara.or@mailbox.example.org",
        "phone": "+44 7700 900318",
        "location": "Bristol, United Kingdom",
        "current_title": "Senior Data Engineer",
        "years_of_experience": 9,
        "skills": ["Python", "SQL", "Apache Airflow", "Kafka", "dbt", "PostgreSQL", "Terraform", "AWS"],
        "work_history": [
            {"company": "Tidewater Logistics", "title": "Senior Data Engineer", "start_year": 2021, "end_year": None},
            {"company": "Harrowgate Retail Group", "title": "Data Engineer", "start_year": 2017, "end_year": 2021},
            {"company": "Selcombe Insurance", "title": "Junior BI Developer", "start_year": 2015, "end_year": 2017},
        ],
        "education": [
            {"institution": "University of Westmere", "degree": "MSc Data Science", "graduation_year": 2015},
            {"institution": "Calder Valley University", "degree": "BSc Mathematics", "graduation_year": 2014},
        ],
    },
    "support_ticket": {
        "customer_name": "Daniel Whitcombe",
        "customer_email": "d.whitcombe@mailbox.example.com",
        "product": "CloudNote Pro annual plan",
        "category": "billing",
        "priority": "high",
        "sentiment": "negative",
        "summary": "Charged twice ($119.00) for one annual Pro plan upgrade; wants the duplicate refunded.",
        "order_id": "CN-448120",
        "requested_action": "refund",
    },
    "paper": {
        "title": "Beaver Dams Buffer Summer Low Flows in Small Upland Catchments: Evidence from a 12-Year Paired Study",
        "authors": [
            {"name": "Hannah Lindgren-Ortiz", "affiliation": "Department of Geography, University of Eastmoor, UK"},
            {"name": "Mateo Quispe", "affiliation": "Andean Water Institute, Cusco, Peru"},
            {"name": "Fiona Bairstow", "affiliation": "Department of Geography, University of Eastmoor, UK"},
        ],
        "year": 2024,
        "venue": "Journal of Applied Freshwater Ecology",
        "doi": "10.5555/jafe.2024.0112",
        "keywords": ["beaver", "hydrology", "low flow", "drought resilience", "nature-based solutions"],
        "abstract_summary": "A 12-year paired-catchment study finds that beaver dams raised late-summer base flow "
        "by 34% and cut zero-flow days from 19 to 3 per year.",
    },
    "product": {
        "name": "AeroSound NC700 Wireless Noise-Cancelling Headphones",
        "brand": "AeroSound",
        "price": 199.99,
        "currency": "USD",
        "condition": "new",
        "category": "Headphones",
        "attributes": {"color": "Midnight Blue", "size": None, "material": None, "weight": "254 g"},
        "in_stock": True,
        "url": "https://shop.example.com/p/aerosound-nc700-wireless-headphones",
    },
}


def accepts(b, grammar, text: str, tokenizer) -> bool:
    """Does the grammar accept `text` (token by token, then EOS)?"""
    m = b.matcher(grammar)
    for token in [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]:
        if not m.accept_token(token):
            return False
    return m.is_terminated()


def too_long(instance: dict, schema: dict) -> dict:
    """`instance` with its first top-level string that has a maxLength made one character too long."""
    for key, prop in schema["properties"].items():
        if "maxLength" in prop and isinstance(instance[key], str):
            return {**instance, key: "x" * (prop["maxLength"] + 1)}
    raise AssertionError("no bounded top-level string")


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_grammar_takes_a_real_extraction_and_enforces_bounds(name, backend_name, tokenizer):
    schema, instance = load(name), EXPECTED[name]
    Draft202012Validator(schema, format_checker=FormatChecker()).validate(instance)
    b, grammar = backend(backend_name, tokenizer), compiled(backend_name, name, tokenizer)
    assert accepts(b, grammar, json.dumps(instance), tokenizer)
    assert accepts(b, grammar, json.dumps(instance, separators=(",", ":")), tokenizer)
    assert not accepts(b, grammar, json.dumps(too_long(instance, schema)), tokenizer)
    assert not accepts(b, grammar, json.dumps({**instance, "extra": 1}), tokenizer)


# ------------------------------------------------------------------------------------------------
# Example inputs


@pytest.mark.parametrize("name", NAMES)
def test_example_file(name):
    lines = (EXAMPLES / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 6
    docs = [json.loads(line) for line in lines]
    for doc in docs:
        assert set(doc) == {"id", "text"}
        assert isinstance(doc["id"], str) and doc["id"].strip()
        assert isinstance(doc["text"], str) and doc["text"].strip()
        assert 300 <= len(doc["text"]) <= 1500, (doc["id"], len(doc["text"]))
    assert len({d["id"] for d in docs}) == len(docs)
    assert len({d["text"] for d in docs}) == len(docs)


def test_example_folder():
    files = sorted((EXAMPLES / "tickets_txt").glob("*.txt"))
    assert len(files) == 3
    for f in files:
        assert len(f.read_text(encoding="utf-8").strip()) >= 200, f


# ------------------------------------------------------------------------------------------------
# The synthetic document generator


@pytest.fixture(scope="module")
def extraction_docs():
    return load_benchmark("extraction_docs")


def test_synthetic_documents_are_deterministic_and_varied(extraction_docs):
    gen = extraction_docs.synthetic_documents
    docs = gen(200, seed=0)
    assert docs == gen(200, seed=0)
    assert gen(50, seed=0) == docs[:50]  # document i depends only on (seed, i)
    other = gen(200, seed=1)
    assert [d["text"] for d in other] != [d["text"] for d in docs]
    assert len({d["id"] for d in docs + other}) == 400
    assert {d["kind"] for d in docs} == set(NAMES)
    for d in docs:
        assert set(d) == {"id", "kind", "text"}
        assert 300 <= len(d["text"]) <= 1500, (d["id"], len(d["text"]))
    assert len({d["text"] for d in docs}) == len(docs)
    for kind in NAMES:
        texts = [d["text"] for d in docs if d["kind"] == kind]
        lengths = sorted(len(t) for t in texts)
        assert lengths[-1] - lengths[0] >= 150, (kind, lengths[0], lengths[-1])  # lengths vary
        first_lines = {t.splitlines()[0] for t in texts}
        assert len(first_lines) >= len(texts) // 2, kind  # not one template with a few slots
    invoices = gen(30, seed=3, kinds=("invoice",))
    assert {d["kind"] for d in invoices} == {"invoice"} and len(invoices) == 30
    with pytest.raises(ValueError):
        gen(3, kinds=("recipe",))


def test_synthetic_documents_command(extraction_docs, tmp_path):
    out = tmp_path / "docs.jsonl"
    extraction_docs.main(["--n", "12", "--kind", "invoice", "--seed", "4", "--out", str(out)])
    docs = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert docs == extraction_docs.synthetic_documents(12, seed=4, kinds=("invoice",))
