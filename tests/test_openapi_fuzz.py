"""schemathesis against the real server, from the server's own /openapi.json: bodies generated from the request
models (and broken variants of them) never get a 5xx, and every answer matches the documented responses (status
code, content type, JSON schema). Bounded: a few dozen examples per route, generation lengths capped."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")
# CI runs 20 examples per route; the longer run of docs/reliability.md sets GRAMSERVE_SCHEMATHESIS_EXAMPLES.
EXAMPLES = int(os.environ.get("GRAMSERVE_SCHEMATHESIS_EXAMPLES", "20"))


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _cap_lengths(body, key: str = "max_tokens") -> None:
    """Generated requests may ask for thousands of tokens (or leave the length to the context); on 2 cores that is
    minutes each. Keep every one short; the values themselves are checked by the other tests."""
    if not isinstance(body, dict):
        return
    for field in LENGTH_FIELDS:
        body.pop(field, None)
    body[key] = 4
    body.pop("min_tokens", None)
    body.pop("min_new_tokens", None)
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2:
        body["prompt"] = body["prompt"][:2]
    if key == "max_tokens" and ("text" in body or "input_ids" in body):  # /generate: its lengths are in here
        body.setdefault("sampling_params", {})
    params = body.get("sampling_params")
    if isinstance(params, dict):
        _cap_lengths(params, "max_new_tokens")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_answers_match_the_schema(case, base_url):
    _cap_lengths(case.body)
    case.call_and_validate(
        base_url=base_url,
        timeout=120,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )
