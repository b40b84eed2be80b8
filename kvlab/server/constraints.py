"""Structured outputs over the wire: OpenAI's `response_format` and vLLM's extras, into StructuredOutputs.

    response_format: {"type": "text"}                                 nothing
                     {"type": "json_object"}                          any JSON object
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    guided_json / guided_regex / guided_choice / guided_grammar       vLLM's older fields
    structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   vLLM's newer one

At most one of them per request. Whether the grammar engine can compile it is the engine's to say
(LLMEngine.check_params), answered with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from kvlab.errors import KvlabError
from kvlab.sampling.params import StructuredOutputs
from kvlab.server.errors import invalid

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """The request's constraint and the field it came from (None, None: unconstrained)."""
    found = []
    for key in FIELDS:
        value = body.get(key)
        if value is None or (key == "response_format" and _is_text(value)):
            continue
        found.append((key, value))
    if not found:
        return None, None
    if len(found) > 1:
        raise invalid(f"give at most one of {', '.join(k for k, _ in found)}", found[1][0])
    key, value = found[0]
    try:
        if key == "response_format":
            return _response_format(value), key
        if key == "structured_outputs":
            if not isinstance(value, dict) or set(value) - set(_SO_KEYS):
                raise invalid(f"'structured_outputs' must be an object with one of {', '.join(_SO_KEYS)}", key)
            return StructuredOutputs(**value), key
        return StructuredOutputs(**{GUIDED[key]: value}), key
    except KvlabError as e:
        raise invalid(str(e), key) from None


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value == {"type": "text"}


def _response_format(value: Any) -> StructuredOutputs:
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise invalid(
            f"'response_format' must be an object whose 'type' is one of {', '.join(kinds)}", "response_format"
        )
    if value["type"] == "json_object":
        if set(value) != {"type"}:
            raise invalid("'response_format' of type json_object takes no other field", "response_format")
        return StructuredOutputs(json_object=True)
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise invalid("'response_format' of type json_schema needs 'json_schema': {'name', 'schema', ...}",
                      "response_format")  # fmt: skip
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise invalid(
            f"'response_format.json_schema' has unknown fields: {', '.join(sorted(unknown))}", "response_format"
        )
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid("'response_format.json_schema.name' is required", "response_format")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise invalid("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return StructuredOutputs(json=schema)
