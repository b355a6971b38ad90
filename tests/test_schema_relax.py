"""schema_relax: what auto's last resort takes out of a schema, and only that."""

from __future__ import annotations

import json

from gramserve.grammar.schema_relax import dropped_keywords, relax


def test_ungrammatical_keywords_are_dropped_with_where():
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "kind": {"enum": ["a", "b"]},
        },
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"required": ["tags"]},
        "dependentRequired": {"kind": ["tags"]},
    }
    relaxed, dropped = relax(schema)
    assert relaxed == {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["a", "b"]}},
    }
    assert sorted(dropped) == ["dependentRequired at /", "if at /", "then at /", "uniqueItems at /properties/tags"]
    assert "uniqueItems" in schema["properties"]["tags"]  # the caller's schema is left as it was


def test_property_names_and_instance_data_that_look_like_keywords_are_kept():
    schema = {
        "type": "object",
        "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
        "required": ["not", "if"],
        "default": {"not": 1, "uniqueItems": True},
        "enum": [{"not": "x", "if": 1}],
    }
    assert relax(schema) == (schema, [])


def test_overlapping_one_of_becomes_any_of_and_disjoint_stays():
    overlap = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    assert relax(overlap) == ({"anyOf": [{"type": "integer"}, {"type": "number"}]}, ["oneOf exclusivity at /"])
    disjoint = {"oneOf": [{"type": "integer"}, {"type": "string"}]}
    assert relax(disjoint) == (disjoint, [])
    both = {"anyOf": [{"type": "integer"}, {"type": "string"}], "oneOf": [{"minimum": 1}, {"maximum": 5}]}
    relaxed, _ = relax(both)
    assert relaxed["anyOf"] == both["anyOf"] and relaxed["allOf"] == [{"anyOf": both["oneOf"]}]


def test_lookaround_patterns_and_unknown_formats_are_dropped_other_ones_kept():
    schema = {
        "type": "object",
        "properties": {
            "pw": {"type": "string", "pattern": "^(?=.*[0-9]).{8}$", "maxLength": 8},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "ptr": {"type": "string", "format": "json-pointer"},
            "when": {"type": "string", "format": "date-time"},
        },
    }
    relaxed, dropped = relax(schema)
    props = relaxed["properties"]
    assert props["pw"] == {"type": "string", "pattern": "^.{8}$", "maxLength": 8}  # the lookahead goes, not the rest
    assert props["code"] == schema["properties"]["code"] and props["when"] == schema["properties"]["when"]
    assert props["ptr"] == {"type": "string"}
    assert len(dropped) == 2


def test_lookaround_groups_come_out_of_a_pattern_and_the_rest_stays():
    from gramserve.grammar.schema_audit import without_lookaround

    assert without_lookaround(r"^(?!aws:)[a-zA-Z+-=._:/]+$") == r"^[a-zA-Z+-=._:/]+$"
    assert without_lookaround(r"^((?!-)[a-z-]*\.)+(?<=x)$") == r"^([a-z-]*\.)+$"
    assert without_lookaround(r"^[(?=]a(?:b)$") == r"^[(?=]a(?:b)$"  # in a class, or a plain group: kept
    assert without_lookaround(r"(a)\1") is None


def test_not_is_rewritten_exactly_before_anything_is_dropped():
    exact = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    assert dropped_keywords(json.dumps(exact)) == []  # rewrite_not states it positively: nothing to relax
    assert dropped_keywords(json.dumps({"type": "string", "not": {"enum": ["x"]}})) == ["not at /"]
    assert dropped_keywords("not json") == []


def test_counts_written_as_floats_are_enforced(tokenizer):
    """ "maxLength": 2.0 is the count 2 (xgrammar ignored the float and let a long string through)."""
    from test_grammar_corpus import accepts, get_backend

    from gramserve.grammar.backends import BACKEND_NAMES
    from gramserve.grammar.compile_process import compile_grammar
    from gramserve.grammar.schema_normalize import integral_counts
    from gramserve.messages import GrammarRequest

    assert integral_counts({"type": "array", "maxItems": 3.0, "items": {"maxLength": 1.5}}) == {
        "type": "array",
        "maxItems": 3,
        "items": {"maxLength": 1.5},
    }
    schema = json.dumps({"type": "string", "maxLength": 2.0})
    for name in BACKEND_NAMES:
        b = get_backend(tokenizer, name)
        try:
            compiled = compile_grammar(b, GrammarRequest("json_schema", schema, name))
        except Exception:  # noqa: BLE001 - a refusal is fine; silently not enforcing is not
            continue
        assert accepts(b, compiled, json.dumps("ab"), tokenizer, check_mask=False), name
        assert not accepts(b, compiled, json.dumps("abc"), tokenizer, check_mask=False), name


def test_opt_in_bounds_on_unbounded_strings_and_arrays(tokenizer):
    """--grammar-max-string-length / --grammar-max-array-items: only what the schema leaves unbounded gets a bound,
    never below the schema's own minimum, and the grammar enforces it."""
    from test_grammar_corpus import accepts, get_backend

    from gramserve.grammar.backends import GrammarOptions
    from gramserve.grammar.compile_process import compile_grammar
    from gramserve.grammar.schema_normalize import bound_unbounded
    from gramserve.messages import GrammarRequest

    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "long": {"type": "string", "minLength": 10},
            "code": {"type": "string", "pattern": "^[a-z]+$"},
            "tags": {"type": "array", "items": {"type": ["string", "null"]}},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}] * 5},
            "few": {"type": "array", "maxItems": 30},
        },
    }
    bounded = bound_unbounded(schema, 4, 2)
    props = bounded["properties"]
    assert props["free"]["maxLength"] == 4 and props["long"]["maxLength"] == 10
    assert "maxLength" not in props["code"] and props["few"]["maxItems"] == 30
    assert props["tags"]["maxItems"] == 2 and props["tags"]["items"]["maxLength"] == 4
    assert props["pair"]["maxItems"] == 5
    assert bound_unbounded(schema, None, None) is schema and "maxLength" not in schema["properties"]["free"]

    b = get_backend(tokenizer, "llguidance", options=GrammarOptions(max_string_length=4, max_array_items=2))
    text = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    compiled = compile_grammar(b, GrammarRequest("json_schema", text, "llguidance"))
    assert accepts(b, compiled, json.dumps({"s": "abcd"}), tokenizer, check_mask=False)
    assert not accepts(b, compiled, json.dumps({"s": "abcde"}), tokenizer, check_mask=False)


def test_what_if_then_else_requires_either_way_stays_required():
    """Dropping if/then/else keeps the properties both branches require (a GPU run gave {"b": -1} for a schema whose
    then and else both require a and c)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"enum": ["x", "y"]}},
        "if": {"properties": {"c": {"const": "x"}}},
        "then": {"required": ["a", "b", "c"]},
        "else": {"required": ["a", "c"]},
    }
    relaxed, dropped = relax(schema)
    assert relaxed["required"] == ["a", "c"] and "if" not in relaxed and len(dropped) == 3
    assert "required" not in relax({**schema, "else": {"required": ["d"]}})[0]  # nothing in common
    assert "required" not in relax({k: v for k, v in schema.items() if k != "else"})[0]  # no else: nothing implied


def test_references_into_relaxed_keywords_still_resolve(tokenizer):
    """A $ref into an overlapping oneOf (SchemaStore's CircleCI schema: #/definitions/step/oneOf/1/properties/run)
    pointed at nothing once relax renamed the oneOf: the schema was refused. The target is now copied under $defs
    first, and the relaxed grammar enforces it."""
    from test_grammar_corpus import accepts, get_backend

    from gramserve.grammar.compile_process import compile_grammar
    from gramserve.grammar.schema_normalize import hoist_deep_refs
    from gramserve.messages import GrammarRequest

    run = {"type": "object", "properties": {"command": {"type": "string", "maxLength": 3}}, "required": ["command"]}
    schema = {
        "definitions": {"step": {"oneOf": [{"type": "object"}, {"type": "object", "properties": {"run": run}}]}},
        "type": "object",
        "properties": {
            "first": {"$ref": "#/definitions/step"},
            "run": {"$ref": "#/definitions/step/oneOf/1/properties/run"},
        },
        "required": ["run"],
    }
    hoisted = hoist_deep_refs(schema)
    assert (
        hoisted["properties"]["run"] == {"$ref": "#/$defs/gramserve_ref_0"}
        and hoisted["$defs"]["gramserve_ref_0"] == run
    )
    assert hoisted["properties"]["first"] == schema["properties"]["first"]  # a shallow reference stays
    assert hoist_deep_refs({"properties": {"a": {"$ref": "#/definitions/x"}}}) == {
        "properties": {"a": {"$ref": "#/definitions/x"}}
    }

    b = get_backend(tokenizer, "llguidance")
    compiled = compile_grammar(b, GrammarRequest("json_schema", json.dumps(schema), "llguidance"), relaxed=True)
    assert accepts(b, compiled, json.dumps({"run": {"command": "ls"}}), tokenizer, check_mask=False)
    assert not accepts(b, compiled, json.dumps({"run": {"command": "make"}}), tokenizer, check_mask=False)
    assert not accepts(b, compiled, json.dumps({"run": {}}), tokenizer, check_mask=False)


def test_annotations_beside_a_recursive_reference_are_dropped(tokenizer):
    """{"$ref": "#/definitions/logic", "markdownDescription": ...} inside the recursive definition itself:
    llguidance refuses a recursive reference with sibling keys it does not know; annotations constrain nothing, so
    they go."""
    from test_grammar_corpus import accepts, get_backend

    from gramserve.grammar.compile_process import compile_grammar
    from gramserve.grammar.schema_normalize import drop_ref_annotations
    from gramserve.messages import GrammarRequest

    logic = {
        "anyOf": [
            {"type": "boolean"},
            {
                "type": "object",
                "properties": {"not": {"$ref": "#/definitions/logic", "markdownDescription": "negation", "x-order": 1}},
                "required": ["not"],
                "additionalProperties": False,
            },
        ]
    }
    schema = {"definitions": {"logic": logic}, "$ref": "#/definitions/logic"}
    dropped = drop_ref_annotations(schema)
    assert dropped["definitions"]["logic"]["anyOf"][1]["properties"]["not"] == {"$ref": "#/definitions/logic"}
    assert "markdownDescription" in logic["anyOf"][1]["properties"]["not"]  # the caller's schema is left as it was
    kept = {"$ref": "#/definitions/a", "minLength": 2, "definitions": {"a": {"type": "string"}}}
    assert drop_ref_annotations(kept) is kept

    b = get_backend(tokenizer, "llguidance")
    compiled = compile_grammar(b, GrammarRequest("json_schema", json.dumps(schema), "llguidance"))
    assert accepts(b, compiled, json.dumps({"not": {"not": True}}), tokenizer, check_mask=False)
    assert not accepts(b, compiled, json.dumps({"not": 1}), tokenizer, check_mask=False)


def test_property_counts_beside_optional_properties_are_left_to_the_check():
    """llguidance counts properties only when every listed one is required (SchemaStore's Bamboo spec was refused);
    relaxed, the count goes to the last check and the rest stays."""
    optional = {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1, "maxProperties": 1}
    relaxed, dropped = relax(optional)
    assert relaxed == {"type": "object", "properties": {"a": {}, "b": {}}}
    assert sorted(dropped) == ["maxProperties at /", "minProperties at /"]
    all_required = {**optional, "required": ["a", "b"]}
    assert relax(all_required) == (all_required, [])


def test_patterns_beyond_the_grammars_regex_syntax_are_left_to_the_check(tokenizer):
    """CloudFormation's resource schemas (cfn-lint) were refused for patterns llguidance cannot read (word
    boundaries, lookahead in patternProperties keys: the lookahead goes, the rest stays), for a pattern it cannot
    intersect with a length range, and for overlapping patternProperties. Relaxed, exactly those go to the last
    check; every other pattern and bound stays enforced by the grammar."""
    from test_grammar_corpus import accepts, get_backend

    from gramserve.grammar.compile_process import compile_grammar
    from gramserve.messages import GrammarRequest

    arn = r"^arn:[\w+=\/,.@-]+:[a-zA-Z0-9\-]+:[a-zA-Z0-9\-]*:[a-zA-Z0-9]{1,12}:[a-zA-Z]+(\/[a-fA-F0-9\-]{36})+$"
    schema = {
        "type": "object",
        "properties": {
            "cron": {"type": "string", "pattern": r"^\b[0-5]?[0-9]\b$"},
            "arn": {"type": "string", "pattern": arn, "minLength": 20, "maxLength": 2048},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 3},
            "tags": {
                "type": "object",
                "patternProperties": {"^(?!aws:)[a-z]+$": {"type": "string"}},
                "additionalProperties": False,
            },
            "env": {
                "type": "object",
                "patternProperties": {"^[a-z]+$": {"type": "integer"}, "[\\S\\s]*": {"type": "integer"}},
                "additionalProperties": False,
            },
        },
        "required": ["code"],
        "uniqueItems": True,  # something relax always drops, so that the relaxed compile is tried
    }
    relaxed, dropped = relax(schema)
    props = relaxed["properties"]
    assert "pattern" not in props["cron"]
    assert props["arn"] == {"type": "string", "pattern": arn}  # the pattern stays, the length range goes
    assert props["code"] == schema["properties"]["code"]
    assert props["tags"]["patternProperties"] == {"^[a-z]+$": {"type": "string"}}
    assert list(props["env"]["patternProperties"]) == ["^[a-z]+$"]
    assert "minLength beside pattern at /properties/arn" in dropped

    b = get_backend(tokenizer, "llguidance")
    compiled = compile_grammar(b, GrammarRequest("json_schema", json.dumps(schema), "llguidance"), relaxed=True)
    assert accepts(b, compiled, json.dumps({"code": "ABC", "env": {"a": 1}}), tokenizer, check_mask=False)
    assert not accepts(b, compiled, json.dumps({"code": "AB1"}), tokenizer, check_mask=False)
    assert not accepts(b, compiled, json.dumps({"code": "ABC", "tags": {"Aws": "x"}}), tokenizer, check_mask=False)


def test_one_of_required_sets_without_a_type_means_an_object():
    """CloudFormation's root schemas have no "type" and a oneOf of required sets: a non-object passes every branch,
    so it fails oneOf. Relaxed to anyOf, the grammar let `null` and `0.7` through (2 invalid outputs of 1,898); the
    object type those branches imply now stays."""
    schema = {"properties": {"a": {}, "b": {}}, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    relaxed, _ = relax(schema)
    assert relaxed["type"] == "object" and relaxed["anyOf"] == schema["oneOf"]
    assert relax({"oneOf": [{"required": ["a"]}, {}]})[0]["type"] == "object"  # {} passes everything
    typed = {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}
    assert "type" not in relax(typed)[0]


def test_a_schema_with_patterns_that_relaxing_cannot_help_is_refused_with_the_exact_reasons(tokenizer):
    """Any schema with a pattern may hold one llguidance cannot read, so its relaxed compile is tried; when relaxing
    changes nothing, the 400 gives the exact candidates' reasons only."""
    from test_grammar_compile_cache import EOS, collect

    from gramserve.grammar.backends import GrammarOptions
    from gramserve.grammar.service import GrammarService
    from gramserve.messages import GrammarCompileReq, GrammarRequest
    from gramserve.sampling.bitmask import allocate_bitmask

    svc = GrammarService(
        tokenizer, len(tokenizer), [EOS], GrammarOptions(), allocate_bitmask(1, len(tokenizer)), fill_threads=0
    )
    nothing = {"type": "object", "oneOf": [{"type": "string", "pattern": "^a+$"}, {"type": "integer"}]}
    try:
        svc.submit(GrammarCompileReq("r", GrammarRequest("json_schema", json.dumps(nothing))))
        error = collect(svc, {"r"})["r"].error
    finally:
        svc.close()
    assert error and "llguidance" in error and "nothing to relax" not in error


def test_unanchored_patterns_match_from_the_start_on_llguidance(tokenizer):
    """llguidance searches for a pattern anywhere in the string (as the spec says), so a model could write junk
    before it forever: an unanchored pattern must match from the start there (a subset: outputs stay valid).
    Patterns anchored at either end, with inline flags, or under allOf stay as they are; xgrammar is left alone."""
    from test_grammar_corpus import accepts, get_backend

    from gramserve.grammar.compile_process import compile_grammar
    from gramserve.grammar.schema_normalize import anchor_patterns
    from gramserve.messages import GrammarRequest

    uuid = "[a-f0-9]{8}-[a-f0-9]{4}-[a-f0-9]{4}"
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": uuid},
            "ext": {"type": "string", "pattern": "\\.json$"},
            "word": {"type": "string", "pattern": "^[a-z]+"},
            "any": {"type": "string", "pattern": "(?i)abc"},
        },
        "required": ["id"],
    }
    props = anchor_patterns(schema)["properties"]
    assert props["id"]["pattern"] == f"^(?:{uuid})" and schema["properties"]["id"]["pattern"] == uuid
    assert [props[k]["pattern"] for k in ("ext", "word", "any")] == ["\\.json$", "^[a-z]+", "(?i)abc"]
    both = {"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}
    assert anchor_patterns(both) is both

    text = json.dumps(schema)
    for backend in ("llguidance", "xgrammar"):  # xgrammar matches the whole string already
        b = get_backend(tokenizer, backend)
        compiled = compile_grammar(b, GrammarRequest("json_schema", text, backend))
        assert accepts(b, compiled, json.dumps({"id": "0123abcd-0000-ffff"}), tokenizer, check_mask=False), backend
        junk_first = json.dumps({"id": "xx0123abcd-0000-ffff"})
        assert not accepts(b, compiled, junk_first, tokenizer, check_mask=False), backend
    b = get_backend(tokenizer, "llguidance")
    compiled = compile_grammar(b, GrammarRequest("json_schema", text, "llguidance"))
    assert accepts(b, compiled, json.dumps({"id": "0123abcd-0000-ffff and more"}), tokenizer, check_mask=False)
