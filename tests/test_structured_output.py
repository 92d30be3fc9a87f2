"""Structured output (xgrammar): every output under a JSON schema parses and validates, greedy or sampled, batched
beside unconstrained rows that decode exactly as they would alone; lookahead and sync agree; bad specs are errors
naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.core.structured import StructuredOutputs
from tests.helpers import greedy, random_ids

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON:", "hello", [5, 6, 7, 8], "The weather today"]


def constrained(temperature: float, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=temperature, seed=seed, structured_outputs={"json": SCHEMA},
                          **kw)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=tiny_dir, dtype="float32", max_batch_size=8)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_under_a_schema_validates(llm, temperature):
    outs = llm.generate(PROMPTS * 2, [constrained(temperature, seed=i) for i in range(8)])
    for out in outs:
        assert out.finish_reason == "stop", out.text          # bounded values and whitespace: it finishes
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_unconstrained_rows_decode_as_they_would_alone(llm):
    plain = [random_ids(30 + i, seed=i) for i in range(3)]
    alone = [o.token_ids for o in llm.generate(plain, greedy(20))]
    mixed = llm.generate([*plain, *PROMPTS[:3]], [greedy(20)] * 3 + [constrained(1.0, seed=s) for s in range(3)])
    assert [o.token_ids for o in mixed[:3]] == alone
    assert all(jsonschema.validate(json.loads(o.text), SCHEMA) is None for o in mixed[3:])


def test_lookahead_and_sync_agree_under_a_grammar(tiny_dir, llm):
    sync = LLM(model=tiny_dir, dtype="float32", max_batch_size=8, lookahead=False)
    params = [constrained(0.0)] * 2 + [constrained(1.0, seed=3), greedy(25)]
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    assert llm.engine.metrics.value("pagoda_decode_lookahead_steps_total") > 0


def test_regex_choice_grammar_and_json_object(llm):
    kinds = [({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             ({"choice": ["yes", "no", "it depends"]}, lambda t: t in ("yes", "no", "it depends")),
             ({"grammar": 'root ::= "(" [a-c]+ ")"'}, lambda t: re.fullmatch(r"\([a-c]+\)", t)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    # any object: a random-weight model would fill a string, or add members, to max_tokens; biases towards '"' and
    # '}' keep strings and objects short (12 seeds of 12 end within 32 tokens)
    quote = {llm.engine.tokenizer.encode('"')[0]: 6.0, llm.engine.tokenizer.encode("}")[0]: 2.0}
    for spec, check in kinds:
        for seed in range(3):
            out = llm.generate("x", SamplingParams(max_tokens=100, temperature=1.0, seed=seed, logit_bias=quote,
                                                   structured_outputs=spec))[0]
            assert out.finish_reason == "stop" and check(out.text), (spec, out.text)


def test_parallel_sequences_each_match(llm):
    out = llm.generate(PROMPTS[0], constrained(1.0, seed=7, n=3))[0]
    assert len({o.text for o in out.outputs}) >= 2
    for seq in out.outputs:
        jsonschema.validate(json.loads(seq.text), SCHEMA)


@pytest.mark.parametrize("spec,message", [
    ({"json": {"type": "nope"}}, "structured_outputs.json: invalid json"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex: invalid regex"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar: invalid grammar"),
    ({"choice": []}, "structured_outputs.choice: expected a list"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs: give exactly one of"),
    ({"whitespace_pattern": " *", "regex": "a"}, "structured_outputs.whitespace_pattern: not supported"),
    ({"jsn": {}}, "structured_outputs.jsn: unknown key"),
    ("[1]", "structured_outputs: expected an object"),
])
def test_bad_specs_name_the_field(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_outputs=spec))
    assert llm.generate("still serving", greedy(2))[0].finish_reason == "length"


def test_triton_keys_structured_outputs_text_and_legacy_guided_decoding():
    """vllm_backend takes structured_outputs as a JSON string, and maps the older guided_decoding onto it."""
    params = SamplingParams.from_dict({"structured_outputs": json.dumps({"regex": "ab+"})})
    assert params.structured_outputs == StructuredOutputs(regex="ab+", field="structured_outputs.regex")
    legacy = SamplingParams.from_dict({"guided_decoding": json.dumps({"choice": ["x"], "backend": "xgrammar"})})
    assert legacy.structured_outputs.choice == ("x",) and legacy.structured_outputs.field == "guided_decoding.choice"
    with pytest.raises(ValueError, match="guided_decoding.backend: not supported"):
        SamplingParams.from_dict({"guided_decoding": {"choice": ["x"], "backend": "outlines"}})
    both = SamplingParams.from_dict({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}})
    assert both.structured_outputs.regex == "a"


def test_the_mlx_runner_refuses_structured_output(tiny_dir):
    pytest.importorskip("mlx.core")
    mlx = LLM(model=tiny_dir, runner="mlx", dtype="float32")
    with pytest.raises(ValueError, match="structured_outputs: not supported by the MLX runner"):
        mlx.generate("x", SamplingParams(structured_outputs={"regex": "a"}))
