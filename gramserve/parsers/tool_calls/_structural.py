"""Builders of xgrammar structural tags (``{"type": "structural_tag", "format": ...}``) for calls.

Per tool choice mode:

* ``auto``: ``triggered_tags`` -- free text, but a trigger (the start of a call marker) must open a
  complete valid call; ``stop_after_first`` when not parallel.
* ``required``: ``tags_with_separator`` with ``at_least_one`` -- calls only, no text.
* ``named``: the one call's tag.

``bound_calls`` then caps the calls of one turn (``--max-parallel-tool-calls``), unrolling each run of calls.

Formats whose calls sit in one section (``<｜tool▁calls▁begin｜>...``) wrap the calls in a section
tag; ``auto`` then triggers on the section start and stops after the section.

Triggers are chosen so that free text cannot contain anything the parser would read as the start
of a call: whatever ``parse`` returns as a call was forced by the grammar.
"""

from __future__ import annotations


def tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def sequence(*elements: dict) -> dict:
    return {"type": "sequence", "elements": list(elements)}


def wrap(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def calls_format(mode: str, parallel: bool, tags: list[dict], *, trigger: str, separator: str) -> dict:
    """Structural tag for formats where each call is one tag."""
    one = mode == "named" or not parallel
    if mode == "named":
        return wrap(tags[0])
    if mode == "auto":
        return wrap(
            {
                "type": "triggered_tags",
                "triggers": [trigger],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": one,
            }
        )
    return wrap(
        {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": one,
        }
    )


def bound_calls(tag: dict, most: int) -> dict:
    """The structural tag with every run of calls (``tags_with_separator`` not stopping after the first) allowed at
    most `most` calls (0: unchanged). The same calls, separator and at_least_one; the grammar ends the run there."""
    if most <= 0:
        return tag

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        node = {k: walk(v) for k, v in node.items()}
        if node.get("type") != "tags_with_separator" or node.get("stop_after_first"):
            return node
        call = node["tags"][0] if len(node["tags"]) == 1 else {"type": "or", "elements": node["tags"]}
        more = sequence(const(node["separator"]), call) if node["separator"] else call
        calls = sequence(call, {"type": "repeat", "min": 0, "max": most - 1, "content": more}) if most > 1 else call
        return calls if node.get("at_least_one") else {"type": "optional", "content": calls}

    return walk(tag)


def section_format(
    mode: str, parallel: bool, tags: list[dict], *, begin: str, end: str, separator: str, trigger: str | None = None
) -> dict:
    """Structural tag for formats whose calls sit between ``begin`` and ``end`` (``auto`` triggers on
    ``trigger``, a prefix of ``begin``, by default ``begin``)."""
    one = mode == "named" or not parallel
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": one,
    }
    section = tag(begin, calls, end)
    if mode == "auto":
        triggers = [trigger or begin]
        return wrap(
            {
                "type": "triggered_tags",
                "triggers": triggers,
                "tags": [section],
                "at_least_one": False,
                "stop_after_first": True,
            }
        )
    return wrap(section)
