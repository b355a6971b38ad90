"""Model-output parsers: tool calls (``tool_calls``) and reasoning (``reasoning``)."""
