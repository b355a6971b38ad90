"""Function calling on the request side: tools, tool_choice and the history, turned into a prompt and a grammar.

- `plan_tools` checks `tools` / `tool_choice` / `parallel_tool_calls` and picks the tool-call parser.
- `render_messages` prepares the history for the chat template: assistant `tool_calls` get dict arguments
  (what templates expect); for a template without tool support the tool list and the call format go into
  the system prompt, past calls are written in the parser's format and tool results become user turns.
- `tool_grammar` builds the structural tag that makes every call well formed and schema-valid:
  `required` / named / `parallel_tool_calls: false` shape it; `auto` lets free text through until a call opens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gramserve.config import ServerArgs
from gramserve.messages import GrammarRequest
from gramserve.parsers.tool_calls import ToolCallParser, ToolFunction, bound_calls, get_tool_call_parser
from gramserve.parsers.tool_calls.base import EMPTY_PARAMETERS
from gramserve.server import protocol as P
from gramserve.server.errors import InvalidRequestError
from gramserve.server.structured_outputs import _schema_text, _structural_tag_text, with_system_text

ToolMode = Literal["none", "auto", "required", "named"]
# OpenAI's newer names for roles that chat templates know by the older ones
_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}
MAX_TOOLS = 128  # as OpenAI


@dataclass
class ToolPlan:
    """What one chat request asks of function calling."""

    tools: list[ToolFunction]
    mode: ToolMode
    function: str | None  # the forced function when mode == "named"
    parallel: bool
    parser_cls: type[ToolCallParser]
    # `auto` with a JSON response format: the text answer (an output without calls) follows this constraint
    answer: GrammarRequest | None = None
    # the output ended on its own (not cut at max_tokens): a required or named call must be in it (the last check)
    whole: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def new_parser(self) -> ToolCallParser:
        return self.parser_cls(self.tools)


def plan_tools(req: P.ChatCompletionRequest, parser_name: str, args: ServerArgs) -> ToolPlan | None:
    """None when the request has no tools and no tool_choice."""
    for legacy in ("functions", "function_call"):
        if (req.model_extra or {}).get(legacy) not in (None, [], "none"):  # a forced call must not be dropped silently
            raise InvalidRequestError(
                f"{legacy} is OpenAI's deprecated form of function calling and is not served: use tools and "
                "tool_choice",
                legacy,
            )
    if not req.tools:
        choice = req.tool_choice
        if choice is None or choice == "none":
            return None
        raise InvalidRequestError("tool_choice requires tools", "tool_choice")
    if len(req.tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are allowed, got {len(req.tools)}", "tools")
    tools: list[ToolFunction] = []
    seen: set[str] = set()
    for t in req.tools:
        fn = t.function
        if fn.name in seen:
            raise InvalidRequestError(f"duplicate tool name {fn.name!r}", "tools")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else EMPTY_PARAMETERS
        # Same checks as response_format schemas: JSON object, size and depth limits.
        params = json.loads(_schema_text(params, args, "tools"))
        if params.get("type", "object") not in ("object", ["object"]):  # as OpenAI: the arguments are an object
            raise InvalidRequestError(
                f'the parameters of tool {fn.name!r} must be a JSON schema of type "object", got {params["type"]!r}',
                "tools",
            )
        if isinstance(params, dict) and "type" not in params:
            # {"properties": ...} alone (MCP servers send such schemas) allows any JSON value: the arguments came
            # back as false, a string or an array. OpenAI's arguments are an object.
            params = {"type": "object", **params}
        tools.append(ToolFunction(name=fn.name, parameters=params, description=fn.description, strict=bool(fn.strict)))
    choice = req.tool_choice or "auto"
    function = None
    if isinstance(choice, P.NamedToolChoice):
        function = choice.function.name
        if function not in seen:
            raise InvalidRequestError(f"tool_choice names {function!r}, which is not in tools", "tool_choice")
        mode: ToolMode = "named"
    else:
        mode = choice
    return ToolPlan(tools, mode, function, req.parallel_tool_calls, get_tool_call_parser(parser_name))


def tool_grammar(plan: ToolPlan, args: ServerArgs, backend: str) -> GrammarRequest | None:
    """The structural tag that constrains calls; None for tool_choice none."""
    if not plan.parses_calls:
        return None
    parser = plan.new_parser()
    tag = parser.structural_tag("named" if plan.mode == "named" else plan.mode, plan.parallel, plan.function)
    tag = bound_calls(tag, args.max_parallel_tool_calls)
    return GrammarRequest(kind="structural_tag", text=_structural_tag_text(tag, args, "tools"), backend=backend)


def calls_or_answer_grammar(plan: ToolPlan, answer: GrammarRequest, args: ServerArgs) -> GrammarRequest | None:
    """tool_choice auto with a JSON response format (OpenAI: the model may call tools, and its text answer follows
    the format): calls, as `required` shapes them, or the answer. None for constraints other than JSON."""
    if answer.backend == "outlines":
        return None  # it compiles no structural tags: the format holds the whole output, as before
    if answer.kind == "json_schema":
        answer_format = {"type": "json_schema", "json_schema": json.loads(answer.text)}
    elif answer.kind == "json_object":
        answer_format = {"type": "json_schema", "json_schema": {"type": "object"}}
    else:
        return None
    calls = plan.new_parser().structural_tag("required", plan.parallel)
    calls = bound_calls(calls, args.max_parallel_tool_calls)["format"]
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [answer_format, calls]}}
    return GrammarRequest(kind="structural_tag", text=_structural_tag_text(tag, args, "tools"), backend=answer.backend)


def call_markers(plan: ToolPlan) -> tuple[str, ...]:
    """Regexes of what begins a call in the plan's format: its parser's region start (`<tool_call>`, `[f(`), not the
    grammar's broader triggers (`[`, `{"`), which plain text also holds."""
    return (plan.parser_cls.start_pattern,)


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


# content['type'], item.type, ... or selectattr('type', ...) over a message's content
_CONTENT_PART_TYPE = re.compile(
    r"""(content|item|part)\s*(\[\s*['"]type['"]\s*\]|\.type\b)|selectattr\(\s*['"]type['"]"""
)


def template_takes_content_parts(chat_template: str | None) -> bool:
    """The template reads a message's content as parts ({"type": "text"} / {"type": "image"}, as vision-language
    models' templates do, e.g. llava-1.5's) rather than as a string."""
    return bool(chat_template) and _CONTENT_PART_TYPE.search(chat_template) is not None


def _call_dict(call: P.ToolCallSpec) -> dict[str, Any]:
    """A history call with object arguments (what templates and call renderers expect). Arguments that are not a JSON
    object become {}: a call cut at max_tokens that an agent framework sends back must not fail the next turn."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = {}
    if not isinstance(args, dict):
        args = {}
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def _parts(content: Any, images: list[str]) -> list[dict[str, Any]]:
    """A message's content as the parts a vision-language template reads; image URLs appended to `images`."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for part in content:
        if part.type == "image_url":
            images.append(_image_url(part))
            parts.append({"type": "image"})
        elif part.type == "text":
            parts.append({"type": "text", "text": part.text or ""})
        else:
            raise InvalidRequestError(f"content part type {part.type!r} is not supported by this model", "messages")
    return parts


def _text(content: Any, images: list[str] | None = None, image_token: str | None = None) -> str:
    """A message's content as text. An image_url part (a vision-language model: `image_token` given) becomes
    `image_token`, its URL appended to `images`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type == "image_url" and image_token is not None and images is not None:
            images.append(_image_url(part))
            parts.append(image_token)
        elif part.type == "text":
            parts.append(part.text or "")
        else:
            raise InvalidRequestError(f"content part type {part.type!r} is not supported by this model", "messages")
    return "".join(parts)


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; every one is served at the model's own resolution


def _image_url(part: Any) -> str:
    spec = getattr(part, "image_url", None)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise InvalidRequestError('an image_url part needs "image_url": {"url": ...}', "messages")
    detail = spec.get("detail") if isinstance(spec, dict) else None
    if detail is not None and detail not in IMAGE_DETAILS:
        raise InvalidRequestError(
            f"image_url.detail must be one of {', '.join(IMAGE_DETAILS)}, not {detail!r}", "messages"
        )
    return url


def render_messages(
    messages: list[P.ChatMessage],
    plan: ToolPlan | None,
    native_tools: bool,
    parser_cls: type[ToolCallParser],
    image_token: str | None = None,
    images: list[str] | None = None,
    content_parts: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the template, `tools=` for the template or None). With `image_token` (a vision-language
    model), image parts are written as that token and their URLs appended to `images`, in order; with
    `content_parts` (its template reads parts) every content goes as parts, images as {"type": "image"}, and the
    template writes the image tokens."""
    out: list[dict[str, Any]] = []
    parser = plan.new_parser() if plan is not None else parser_cls([])
    for m in messages:
        d = m.model_dump(exclude_none=True, exclude={"tool_calls", "content"})
        d["role"] = _TEMPLATE_ROLES.get(m.role, m.role)
        if content_parts and images is not None:
            d["content"] = _parts(m.content, images)
        else:
            d["content"] = _text(m.content, images, image_token)
        if m.tool_calls:
            calls = [_call_dict(c) for c in m.tool_calls]
            if native_tools:
                d["tool_calls"] = calls
            else:
                rendered = parser.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
                d["content"] = (d["content"] + "\n" if d["content"] else "") + rendered
        if d["role"] == "tool" and not native_tools:
            d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
        out.append(d)
    if plan is None or not plan.parses_calls:
        return out, None
    if native_tools:
        return out, [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters},
            }
            for t in plan.tools
        ]
    instructions = parser.system_prompt()
    if plan.mode == "named":
        instructions += f"\nYou must call the function {plan.function}."
    elif plan.mode == "required":
        instructions += "\nYou must call at least one function."
    return with_system_text(out, instructions), None
