"""The prompt of an extraction: a system message with the instruction and the schema (the same for every document,
so the prefix cache computes it once), and a user message rendered from a Jinja template with the document.

Template variables: `text` (the document's text), `id`, `doc` (its whole JSON line) and `schema` (the schema as
indented JSON).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import jinja2
import jinja2.sandbox

DEFAULT_SYSTEM = (
    "You extract information from documents. Read the document and answer with one JSON object that follows this "
    "JSON schema, with values taken from the document.\n\nJSON schema:\n{schema}"
)
DEFAULT_TEMPLATE = "Document:\n{{ text }}\n\nExtract the fields as JSON."


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class PromptBuilder:
    schema: dict
    template: str = DEFAULT_TEMPLATE
    system: str | None = DEFAULT_SYSTEM  # "{schema}" is replaced by the schema; None: no system message

    def __post_init__(self) -> None:
        try:
            _environment().from_string(self.template)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"the prompt template does not parse: {exc}") from exc

    def schema_text(self) -> str:
        return json.dumps(self.schema, indent=2, ensure_ascii=False)

    def system_message(self) -> dict | None:
        """The message every prompt starts with (None: no system message)."""
        if self.system is None:
            return None
        return {"role": "system", "content": self.system.replace("{schema}", self.schema_text())}

    def messages(self, doc_id: str, text: str, record: dict) -> list[dict]:
        """The chat messages for one document (a template error raises TemplateError)."""
        try:
            user = (
                _environment()
                .from_string(self.template)
                .render(text=text, id=doc_id, doc=record, schema=self.schema_text())
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the prompt template failed: {exc}") from exc
        system = self.system_message()
        return ([system] if system is not None else []) + [{"role": "user", "content": user}]


def _environment() -> jinja2.Environment:
    return jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
