"""The constraint -> grammar step: `disable_additional_properties` closes the object schemas of
a JSON schema, subschemas included, and never rewrites data (const, enum, default)."""

from __future__ import annotations

import json

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.grammar import _closed_objects, build_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string"},  # a property named like a keyword
        "inner": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "fixed": {"const": {"type": "object"}, "default": {"properties": {}}},
        "list": {"type": "array", "items": {"type": "object"}},
        "open": {"type": "object", "additionalProperties": True},
    },
    "$defs": {"X": {"properties": {"q": {}}}},
    "anyOf": [{"type": "object"}, {"type": "string"}],
}


def test_closed_objects_touches_object_schemas_only():
    got = _closed_objects(SCHEMA)
    props = got["properties"]
    assert got["additionalProperties"] is False
    assert props["inner"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert got["$defs"]["X"]["additionalProperties"] is False
    assert got["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in got["anyOf"][1]
    assert props["open"]["additionalProperties"] is True  # what a schema says stays
    assert props["type"] == {"type": "string"}
    assert props["fixed"] == SCHEMA["properties"]["fixed"]  # data, not schemas
    assert "additionalProperties" not in SCHEMA  # the caller's schema is not changed


def _schema_of(grammar: str) -> dict:
    # llguidance's grammar text is JSON naming the schema it compiles (plus its own options).
    schema = json.loads(grammar)["grammars"][0]["json_schema"]
    schema.pop("x-guidance", None)
    return schema


def test_the_option_reaches_the_grammar():
    closed = build_grammar(StructuredOutputsParams(json=SCHEMA,
                                                   disable_additional_properties=True))
    plain = build_grammar(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert _schema_of(closed) == _closed_objects(SCHEMA)
    assert _schema_of(plain) == SCHEMA
