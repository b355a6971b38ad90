"""System prompt text listing the tools and the exact call format, for chat templates that ignore
``tools``."""

from __future__ import annotations

import json


def _example_args(parameters: dict) -> dict:
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict):
        return {}
    required = parameters.get("required") or list(props)[:1]
    samples = {"string": "...", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}, "null": None}
    out = {}
    for k in required:
        s = props.get(k) if isinstance(props.get(k), dict) else {}
        if isinstance(s.get("enum"), list) and s["enum"]:
            out[k] = s["enum"][0]
        else:
            t = s.get("type")
            out[k] = samples.get(t if isinstance(t, str) else "string", "...")
    return out


def system_prompt(parser) -> str:
    from .base import parameters_of

    specs = "\n".join(
        json.dumps(
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": parameters_of(t)},
            },
            ensure_ascii=False,
        )
        for t in parser.tools
    )
    example = several = ""
    if parser.tools:
        t = parser.tools[0]
        call = (t.name, _example_args(parameters_of(t)))
        example = parser.render_calls([call])
        several = f"\nSeveral calls at once are written like this:\n{parser.render_calls([call, call])}\n"
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> tags:\n<tools>\n{specs}\n</tools>\n\n"
        "To call a function, reply with the call in exactly this format (arguments must follow the "
        f"function's parameter schema), with no other text inside it:\n{example}\n{several}"
    )
