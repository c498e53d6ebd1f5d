"""A request's structured-output spec -> an llguidance grammar, validated.

One function turns every kind of constraint (JSON schema, any JSON object, regex, choice, Lark or
GBNF grammar) into the grammar string llguidance's matchers take; the same string keys the
engine's compiled-grammar cache, so two requests with the same spec share one compilation.
Validation needs no tokenizer, so the frontend refuses a bad spec before anything is queued.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, cast

import llguidance
from llguidance.gbnf_to_lark import any_to_lark


class StructuredOutputsSpec(Protocol):
    """What a grammar is built from: sampling_params.py's `StructuredOutputsParams`, named by
    its fields here because that module validates its spec through this one. Exactly one of
    json, json_object, regex, choice and grammar is set; `kind` names it."""

    @property
    def json(self) -> str | dict[str, Any] | None: ...
    @property
    def json_object(self) -> bool | None: ...
    @property
    def regex(self) -> str | None: ...
    @property
    def choice(self) -> list[str] | None: ...
    @property
    def grammar(self) -> str | None: ...
    @property
    def disable_any_whitespace(self) -> bool: ...
    @property
    def disable_additional_properties(self) -> bool: ...
    @property
    def whitespace_pattern(self) -> str | None: ...
    @property
    def kind(self) -> str: ...


# What `json_object` allows: any JSON object (vLLM's and OpenAI's meaning).
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def _json_options(params: StructuredOutputsSpec) -> dict[str, Any]:
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    return options


# Keywords whose value is a subschema, a list of them, or a map of names to them; everything
# else (const, enum, default, examples, ...) is data and left as it is.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "additionalProperties", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not
    say, its subschemas included."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed_objects(s) for name, s in out[key].items()}
    if (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def build_grammar(params: StructuredOutputsSpec) -> str:
    """The llguidance grammar of `params` (not validated: see `validate_grammar`)."""
    if params.json is not None or params.json_object:
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"SamplingParams.structured_outputs.json is not valid "
                                     f"JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"SamplingParams.structured_outputs.json must be a JSON "
                                 f"schema (an object), got {type(schema).__name__}")
        else:
            schema = ANY_JSON_OBJECT
        if params.disable_additional_properties:
            schema = _closed_objects(schema)
        # cast: llguidance's stub types the options as its own TypedDict.
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=cast(Any, _json_options(params)))
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None  # StructuredOutputsParams checks exactly one kind is set
    lark = params.grammar
    if "::=" in lark:  # GBNF (llama.cpp's EBNF dialect); Lark uses ':'
        try:
            lark = any_to_lark(lark)
        except Exception as e:  # the converter raises plain Exceptions on syntax errors
            raise ValueError(f"SamplingParams.structured_outputs.grammar is not a valid GBNF "
                             f"grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def validate_grammar(params: StructuredOutputsSpec) -> str:
    """The grammar of `params`; ValueError naming the constraint and llguidance's message when
    the schema, regex or grammar is invalid."""
    grammar = build_grammar(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        detail = messages[0].strip() if messages else "rejected by llguidance"
        raise ValueError(f"SamplingParams.structured_outputs.{params.kind} is invalid: {detail}")
    return grammar
