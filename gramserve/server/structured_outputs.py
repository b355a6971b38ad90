"""Turn the request fields that constrain output into one GrammarRequest, with limits checked.

Accepted spellings, so existing clients work unchanged:
- OpenAI: `response_format` = text | json_object | json_schema (strict or not) | structural_tag
- SGLang: top-level `regex`, `ebnf`, `structural_tag`, `json_schema`; /generate's sampling_params of the same names
- vLLM: `structured_outputs` = {json | regex | choice | grammar | json_object | structural_tag},
  and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
Per request, `grammar_backend` (or vLLM's `guided_decoding_backend`) picks the backend.
"""

from __future__ import annotations

import json
from typing import Any

from gramserve.config import ServerArgs
from gramserve.messages import GrammarRequest
from gramserve.server.errors import InvalidRequestError

BACKENDS = ("xgrammar", "llguidance", "outlines", "auto")


# vLLM's names, and its older "name:option,..." form (the options are whitespace and fallback choices, which this
# server makes itself: bounded whitespace, `auto`'s fallback).
BACKEND_ALIASES = {"guidance": "llguidance"}
VLLM_BACKEND_OPTIONS = ("disable-any-whitespace", "disable-fallback", "no-fallback", "no-additional-properties")
# structured_outputs keys besides the constraints: vLLM's options this server has no use for (see above)
STRUCTURED_OUTPUTS_OPTIONS = (
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def checked_backend(backend: Any, param: str = "grammar_backend") -> str:
    if not isinstance(backend, str):
        raise InvalidRequestError(f"{param} must be one of {list(BACKENDS)}, got {backend!r}", param)
    name = backend.split(":", 1)[0]
    options = backend.split(":", 1)[1].split(",") if ":" in backend else []
    name = BACKEND_ALIASES.get(name, name)
    if name not in BACKENDS or any(o not in VLLM_BACKEND_OPTIONS for o in options):
        raise InvalidRequestError(f"{param} must be one of {list(BACKENDS)}, got {backend!r}", param)
    return name


def _json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, stopping early once past `limit` (iterative: no recursion limit)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _schema_text(schema: Any, args: ServerArgs, param: str) -> str:
    if isinstance(schema, str):
        if len(schema.encode()) > args.grammar_max_bytes:
            raise InvalidRequestError(f"the JSON schema is larger than the {args.grammar_max_bytes}-byte limit", param)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param) from exc
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequestError("the JSON schema must be a JSON object", param)
    if _json_depth(schema, args.grammar_max_depth) > args.grammar_max_depth:
        raise InvalidRequestError(
            f"the JSON schema document nests deeper than {args.grammar_max_depth} levels of JSON (--grammar-max-depth; "
            "a subschema under properties counts two: the properties object and the subschema)",
            param,
        )
    text = json.dumps(schema, ensure_ascii=False)
    if len(text.encode()) > args.grammar_max_bytes:
        raise InvalidRequestError(f"the JSON schema is larger than the {args.grammar_max_bytes}-byte limit", param)
    return text


def _grammar_text(text: Any, args: ServerArgs, param: str) -> str:
    if not isinstance(text, str) or not text:  # " " is a regex of one space
        raise InvalidRequestError(f"{param} must be a non-empty string", param)
    if len(text.encode()) > args.grammar_max_bytes:
        raise InvalidRequestError(f"{param} is larger than the {args.grammar_max_bytes}-byte limit", param)
    return text


def _choice_text(choices: Any, args: ServerArgs, param: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param)
    return _grammar_text(json.dumps(choices, ensure_ascii=False), args, param)


def _structural_tag_text(tag: Any, args: ServerArgs, param: str) -> str:
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param) from exc
    if not isinstance(tag, dict):
        raise InvalidRequestError(f"{param} must be a JSON object", param)
    return _grammar_text(json.dumps(tag, ensure_ascii=False), args, param)


def _from_response_format(rf: Any, args: ServerArgs) -> tuple[str, str] | None:
    if not isinstance(rf, dict) or "type" not in rf:
        raise InvalidRequestError("response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format.json_schema.schema is required", "response_format")
        return "json_schema", _schema_text(spec["schema"], args, "response_format")
    if kind == "structural_tag":
        return "structural_tag", _structural_tag_text(rf, args, "response_format")
    raise InvalidRequestError(
        f"response_format type {kind!r} is not supported; use text, json_object, json_schema or structural_tag",
        "response_format",
    )


def grammar_from_fields(fields: dict[str, Any], args: ServerArgs) -> GrammarRequest | None:
    """`fields` holds the request's top-level fields (or /generate's sampling_params)."""
    found: list[tuple[str, str, str]] = []  # (param, kind, text)

    def add(param: str, kind: str, text: str) -> None:
        found.append((param, kind, text))

    if fields.get("response_format") is not None:
        got = _from_response_format(fields["response_format"], args)
        if got:
            add("response_format", *got)
    for name in ("json_schema", "guided_json"):
        if fields.get(name) is not None:
            add(name, "json_schema", _schema_text(fields[name], args, name))
    for name in ("regex", "guided_regex"):
        if fields.get(name) is not None:
            add(name, "regex", _grammar_text(fields[name], args, name))
    for name in ("ebnf", "guided_grammar"):
        if fields.get(name) is not None:
            add(name, "ebnf", _grammar_text(fields[name], args, name))
    for name in ("choice", "guided_choice"):
        if fields.get(name) is not None:
            add(name, "choice", _choice_text(fields[name], args, name))
    if fields.get("structural_tag") is not None:
        add("structural_tag", "structural_tag", _structural_tag_text(fields["structural_tag"], args, "structural_tag"))
    so = fields.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("structured_outputs must be an object", "structured_outputs")
        known = set(STRUCTURED_OUTPUTS_KINDS) | set(STRUCTURED_OUTPUTS_OPTIONS)
        unknown = sorted(k for k in so if k not in known and not k.startswith("_"))  # _backend: vLLM's own fields
        if unknown:  # a misspelt key left the output unconstrained
            raise InvalidRequestError(
                f"structured_outputs has unknown keys {unknown}; it takes one of {list(STRUCTURED_OUTPUTS_KINDS)}",
                "structured_outputs",
            )
        if so.get("json") is not None:
            add("structured_outputs.json", "json_schema", _schema_text(so["json"], args, "structured_outputs"))
        if so.get("regex") is not None:
            add("structured_outputs.regex", "regex", _grammar_text(so["regex"], args, "structured_outputs"))
        if so.get("choice") is not None:
            add("structured_outputs.choice", "choice", _choice_text(so["choice"], args, "structured_outputs"))
        if so.get("grammar") is not None:
            add("structured_outputs.grammar", "ebnf", _grammar_text(so["grammar"], args, "structured_outputs"))
        if so.get("json_object"):
            add("structured_outputs.json_object", "json_object", "")
        if so.get("structural_tag") is not None:
            add(
                "structured_outputs.structural_tag",
                "structural_tag",
                _structural_tag_text(so["structural_tag"], args, "structured_outputs"),
            )
    backend, backend_param = args.grammar_backend, "grammar_backend"
    for name, value in (
        ("grammar_backend", fields.get("grammar_backend")),
        ("guided_decoding_backend", fields.get("guided_decoding_backend")),
        ("structured_outputs.backend", so.get("backend") if isinstance(so, dict) else None),
    ):
        if value is not None:
            backend, backend_param = checked_backend(value, name), name  # checked even without a constraint
            break
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for p, _, _ in found)
        raise InvalidRequestError(f"give at most one output constraint; got {names}", found[1][0])
    param, kind, text = found[0]
    return GrammarRequest(kind=kind, text=text, backend=checked_backend(backend, backend_param), param=param)


SCHEMA_INSTRUCTION = "Answer with JSON that follows this JSON schema:\n"


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The chat messages with `text` added to the system (or developer) message, or in a system message first."""
    out = list(messages)
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {**out[0], "content": (str(out[0].get("content") or "") + "\n\n" + text).strip()}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def with_schema_in_prompt(messages: list[dict[str, Any]], schema_text: str) -> list[dict[str, Any]]:
    """`--grammar-schema-in-prompt`: the response_format schema written into the system prompt, as OpenAI does for
    strict schemas, so that the model knows the fields it is to fill and where they end (the grammar alone forces
    the shape but not when a string or array ends: small models run on to max_tokens)."""
    return with_system_text(messages, SCHEMA_INSTRUCTION + schema_text)
