"""Triton tensor parsing and the metrics mirror, without a server."""
from __future__ import annotations

import numpy as np
import pytest

from engine.frontends import triton_io
from engine.serving.metrics import Metrics, Mirror


def s(text: str | bytes) -> np.ndarray:
    return np.array([text if isinstance(text, bytes) else text.encode()], dtype=np.object_)


def b(value: bool) -> np.ndarray:
    return np.array([value])


def test_parse_text_and_defaults():
    r = triton_io.parse({"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": "7", "temperature": "0"}')})
    assert (r.prompt, r.params.max_tokens, r.params.temperature, r.stream) == ("hi", 7, 0.0, False)
    assert r.prepend_input                       # vLLM backend default for non-streaming text requests
    r = triton_io.parse({"text_input": s("hi"), "stream": b(True), "return_cached_tokens": b(True),
                         "return_finish_reason": b(False)})
    assert r.stream and not r.prepend_input and r.extras == ["cached_tokens"]
    r = triton_io.parse({"input_ids": np.array([1, 2, 3], dtype=np.int32)})
    assert r.prompt == [1, 2, 3] and not r.prepend_input


def test_decode_timing_outputs_are_the_engines_once_a_sequence_ends():
    r = triton_io.parse({"text_input": s("hi"), "return_decode_timing": b(True)})
    assert r.extras == ["decode_tok_s", "decode_cpu_ms"]
    parts = [triton_io.Part(timing=(250.0, 3.5)), triton_io.Part()]         # n = 2: the second still runs
    out = triton_io.outputs(parts, r.extras, 10, 0)
    assert out["decode_tok_s"].tolist() == [250.0, 0.0] and out["decode_cpu_ms"].tolist() == [3.5, 0.0]
    assert out["decode_tok_s"].dtype == np.float32
    assert "decode_tok_s" not in triton_io.outputs(parts, [], 10, 0)      # only when asked


def test_request_parameters_are_the_sampling_parameters_when_no_tensor_is_sent():
    """vllm_backend's precedence: the sampling_parameters tensor when sent, else the request's Triton parameters
    (JSON text of an object whose values are strings, integers, doubles or booleans)."""
    text = {"text_input": s("hi")}
    r = triton_io.parse(text, '{"temperature": 0, "max_tokens": 12, "ignore_eos": true, "top_p": "0.5"}')
    assert (r.params.temperature, r.params.max_tokens, r.params.ignore_eos, r.params.top_p) == (0.0, 12, True, 0.5)
    assert triton_io.parse(text, '{"max_tokens": 12.0, "n": "2"}').params.max_tokens == 12      # a whole double
    lists = triton_io.parse(text, {"stop": '["a", "b"]', "stop_token_ids": "[7, 9]", "logit_bias": '{"5": -3}',
                                   "bad_words": '["x"]', "allowed_token_ids": "[1, 2]"}).params
    assert (lists.stop, lists.stop_token_ids, lists.logit_bias) == (["a", "b"], [7, 9], {5: -3.0})
    assert (lists.bad_words, lists.allowed_token_ids) == (["x"], [1, 2])
    assert triton_io.parse(text, {"stop": "[end"}).params.stop == ["[end"]      # a plain stop string
    assert triton_io.parse(text, {"stop": "\n"}).params.stop == ["\n"]
    both = triton_io.parse({**text, "sampling_parameters": s('{"max_tokens": 2}')}, '{"max_tokens": 9}')
    assert both.params.max_tokens == 2
    assert triton_io.parse(text, "{}").params.max_tokens == triton_io.parse(text, None).params.max_tokens == 16


@pytest.mark.parametrize("parameters,message", [
    ('{"temperature": "hot"}', "temperature: expected a number"),
    ('{"max_tokens": 0}', "max_tokens: must be >= 1"),
    ('{"max_tokens": 2.5}', "max_tokens: expected an integer"),
    ('{"stop_token_ids": "[1, x]"}', "stop_token_ids: expected JSON text of a list"),
    ('{"colour": "blue"}', "colour: unknown sampling parameter"),
    ("{bad", "parameters: not valid JSON"),
])
def test_request_parameter_errors_name_the_key(parameters, message):
    with pytest.raises(ValueError, match=message):
        triton_io.parse({"text_input": s("hi")}, parameters)


@pytest.mark.parametrize("inputs,message", [
    ({}, "text_input: give exactly one of text_input and input_ids"),
    ({"text_input": s("a"), "input_ids": np.array([1], dtype=np.int32)}, "text_input: give exactly one"),
    ({"text_input": s(b"\xff\xfe")}, "text_input: not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input: expected one string"),
    ({"input_ids": np.array([1], dtype=np.int64)}, "input_ids: expected INT32"),
    ({"input_ids": np.array([[1]], dtype=np.int32)}, "input_ids: expected rank 1"),
    ({"text_input": s("a"), "sampling_parameters": s("{bad")}, "sampling_parameters: not valid JSON"),
    ({"text_input": s("a"), "sampling_parameters": s('{"top_p": 2}')}, "top_p: must be in"),
    ({"text_input": s("a"), "stream": b(True), "exclude_input_in_output": b(False)}, "exclude_input_in_output"),
])
def test_parse_errors_name_the_field(inputs, message):
    with pytest.raises(ValueError, match=message):
        triton_io.parse(inputs)


def test_engine_errors_use_triton_names():
    assert triton_io.error_message("prompt: must not be empty") == "text_input: must not be empty"
    assert triton_io.error_message("top_p: must be in (0, 1]") == "top_p: must be in (0, 1]"


def test_outputs():
    Part = triton_io.Part
    out = triton_io.outputs([Part("hé", [5, 6], "stop")], ["finish_reason", "cached_tokens"], 10, 8)
    assert out["text_output"][0].decode() == "hé" and out["output_ids"].dtype == np.int32
    assert out["finish_reason"][0] == b"stop" and out["cached_tokens"].tolist() == [8]
    assert "num_input_tokens" not in out
    counted = triton_io.outputs([Part("x", [5, 6, 7])], ["num_output_tokens", "num_input_tokens", "finish_reason"],
                                10, 0)
    assert counted["num_output_tokens"].tolist() == [3] and counted["num_input_tokens"].tolist() == [10]
    assert counted["finish_reason"].tolist() == [b"None"]          # vllm_backend: str(None) while it runs


def test_outputs_carry_one_element_per_sequence():
    Part = triton_io.Part
    parts = [Part("a", [1], None, [], 0.0), Part("", [], "length", [], -1.5), Part("bc", [2, 3], "stop", [], -2.0)]
    out = triton_io.outputs(parts, ["finish_reason", "num_output_tokens", "cumulative_logprob", "logprobs"], 4, 0)
    assert out["text_output"].tolist() == [b"a", b"", b"bc"]
    assert out["finish_reason"].tolist() == [b"None", b"length", b"stop"]
    assert out["num_output_tokens"].tolist() == [1, 0, 2] and out["output_ids"].tolist() == [1, 2, 3]
    assert out["cumulative_logprob"].tolist() == [0.0, -1.5, -2.0] and out["logprobs"].tolist() == [b"[]"] * 3


class FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets, self.value, self.observed, self.sets = labels, buckets, 0.0, [], 0

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v
        self.sets += 1

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    families: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.families[name] = self

    def Metric(self, labels, buckets=None):
        m = FakeMetric(labels, buckets)
        self.metrics.append(m)
        return m


def test_mirror_copies_counters_gauges_and_histograms():
    m = Metrics()
    mirror = Mirror(m, FakeFamily, {"counter": "C", "gauge": "G", "histogram": "H"}, {"model": "llm"})
    fam = FakeFamily.families
    assert fam["pagoda_requests_total"].kind == "C" and fam["pagoda_kv_blocks"].kind == "G"
    m.requests.labels(status="completed").inc(3)
    m.kv_blocks.labels(state="free").set(7)
    m.observe("pagoda_time_to_first_token_seconds", 0.2)
    mirror.sync()
    m.requests.labels(status="completed").inc()
    mirror.sync()
    req = fam["pagoda_requests_total"].metrics[0]
    assert req.value == 4 and req.labels == {"model": "llm", "status": "completed"}
    assert fam["pagoda_kv_blocks"].metrics[0].value == 7
    ttft = fam["pagoda_time_to_first_token_seconds"].metrics[0]
    assert ttft.observed == [0.2] and ttft.buckets[0] == 0.005
    # an idle engine's sync sends nothing: each set is a round trip to tritonserver, and one in flight when
    # tritonserver gives up on a shutdown leaves the stub (and the engine under it) waiting for ever
    gauges = [x for f in fam.values() if f.kind == "G" for x in f.metrics]
    sets = sum(x.sets for x in gauges)
    mirror.sync()
    assert sum(x.sets for x in gauges) == sets
    m.kv_blocks.labels(state="free").set(6)
    mirror.sync()
    assert sum(x.sets for x in gauges) == sets + 1 and fam["pagoda_kv_blocks"].metrics[0].value == 6


def test_every_series_exists_before_any_request():
    """Counters at 0 for each label value, the KV gauges, empty histograms: in the registry and in the mirror."""
    m = Metrics()
    names = {name for name, _ in m.series()}
    assert {"pagoda_requests_total", "pagoda_prompt_cache_hits_total", "pagoda_engine_restarts_total",
            "pagoda_time_to_first_token_seconds_count", "pagoda_time_to_first_token_seconds_bucket"} <= names
    assert {labels["status"] for name, labels in m.series() if name == "pagoda_requests_total"} == \
        {"completed", "cancelled", "error", "refused"}
    assert {labels["state"] for name, labels in m.series() if name == "pagoda_kv_blocks"} == {"free", "used", "cached"}
    FakeFamily.families = {}
    mirror = Mirror(m, FakeFamily, {"counter": "C", "gauge": "G", "histogram": "H"}, {"model": "llm"})
    mirror.sync()
    made = {(name, tuple(sorted(x.labels.items()))) for name, fam in FakeFamily.families.items() for x in fam.metrics}
    for fam in m.registry.collect():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        for s in fam.samples:
            if fam.type != "histogram" and (fam.type == "gauge" or s.name.endswith("_total")):
                assert (name, tuple(sorted({"model": "llm", **s.labels}.items()))) in made, s.name
        if fam.type == "histogram":           # vLLM's histograms keep their own labels (model_name, engine)
            assert (name, tuple(sorted({"model": "llm", **m.histogram_labels.get(name, {})}.items()))) in made
