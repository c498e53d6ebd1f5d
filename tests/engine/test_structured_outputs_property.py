"""Generated JSON schemas (objects, arrays, enums, nesting, string lengths, integer bounds):
every output of `tiny-qwen2` under a schema validates against it with `jsonschema`, greedy and
seeded. Schemas are bounded (lengths, items, values) so that a random model's output ends within
max_tokens; derandomized, so a run cannot flake."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from tests.utils import assert_pool_free, kv_budget_kwargs

NAMES = st.sampled_from(["id", "name", "tags", "x", "value", "kind", "n"])


@st.composite
def string_schema(draw) -> dict:
    lo = draw(st.integers(0, 3))
    return {"type": "string", "minLength": lo, "maxLength": draw(st.integers(lo, 6))}


@st.composite
def integer_schema(draw) -> dict:
    lo = draw(st.integers(-50, 50))
    return {"type": "integer", "minimum": lo, "maximum": draw(st.integers(lo, lo + 200))}


ENUM = st.lists(st.one_of(st.sampled_from(["a", "bb", "c d", "é"]), st.integers(-3, 30)),
                min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v})
LEAF = st.one_of(string_schema(), integer_schema(), ENUM, st.just({"type": "boolean"}))


def containers(children: st.SearchStrategy) -> st.SearchStrategy:
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 1)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})
    return st.one_of(arrays, objects)


SCHEMAS = st.dictionaries(NAMES, st.recursive(LEAF, containers, max_leaves=4), min_size=1,
                          max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props),
                   "additionalProperties": False})


@pytest.fixture(scope="module")
def llm():
    args = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                show_progress=False, num_kv_blocks=256, multiprocess_mode=False,
                async_scheduling=True, topk_sampling=True)
    args.update(kv_budget_kwargs())
    return LLM(model=str(tiny_qwen2_path()), **args)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_generated_schemas_hold(llm, schema):
    spec = dict(json=schema, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec),
              SamplingParams(temperature=1.0, seed=11, max_tokens=200, structured_outputs=spec)]
    outs = llm.generate(["Fill in the record:", "{"], params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert_pool_free(llm)
