"""Integration: the decoupled model in a real tritonserver, over gRPC streaming, HTTP and perf_analyzer."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from client.metrics import scrape
from client.stream import grpc_inputs, stream_grpc, stream_http
from engine import LLM, SamplingParams
from scripts import tritonserver as triton_server
from tests.helpers import collect, missing_series, random_ids, stop_checked, triton_post, wait_until

PROMPT = ("A serving engine reads a prompt, turns it into tokens, and computes the keys and values of every token "
          "once. Those keys and values are kept in a cache, so that each new token only attends to what was already "
          "computed.")


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32"}, log)
    yield srv
    stop_checked(srv)


def test_every_series_exists_before_any_request(server):
    """First in this module: the server has served nothing yet. A dashboard or router sees every pagoda_* series,
    counters at 0 and the pool's size free."""
    assert missing_series(server.metrics_url) == []
    assert scrape(server.metrics_url, "pagoda_kv_blocks", state="free") > 0
    assert scrape(server.metrics_url, "pagoda_requests_total", status="completed") == 0


def test_stream_matches_offline_and_reports_extras(server, tiny_dir):
    params = {"max_tokens": "16", "temperature": 0}
    flags = dict(return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True,
                 return_cached_tokens=True)
    responses, error = collect(server, grpc_inputs(PROMPT, params, **flags))
    assert error is None
    expected = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0]
    assert len(responses) == 16
    assert [r["final"] for r in responses] == [False] * 15 + [True]
    assert "".join(r["text_output"][0].decode() for r in responses) == expected.text
    assert [int(i) for r in responses for i in r["output_ids"]] == expected.token_ids
    last = responses[-1]
    assert last["finish_reason"][0].decode() == "length"
    assert int(last["num_input_tokens"][0]) == expected.num_prompt_tokens
    # vllm_backend's num_output_tokens: the tokens in each response, so they sum to the total
    assert [int(r["num_output_tokens"][0]) for r in responses] == [len(r["output_ids"]) for r in responses]
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == 16
    assert int(last["cached_tokens"][0]) == 0

    again, _ = collect(server, grpc_inputs(PROMPT, params, **flags))
    assert int(again[-1]["cached_tokens"][0]) > 0
    wait_until(lambda: scrape(server.metrics_url, "pagoda_time_to_first_token_seconds_count") >= 2,
               "the metrics mirror to show both requests")
    assert scrape(server.metrics_url, "pagoda_prompt_cache_hits_total", model="llm", version="1") >= 1
    assert scrape(server.metrics_url, "pagoda_decode_lookahead_steps_total") > 0
    assert scrape(server.metrics_url, "pagoda_kv_blocks", state="free") > 0
    assert scrape(server.metrics_url, "pagoda_kv_blocks", state="cached") > 0
    assert scrape(server.metrics_url, "pagoda_time_to_first_token_seconds_count") >= 2


def test_logprobs_and_cumulative_logprob(server, tiny_dir):
    """vllm_backend's return_logprobs (JSON of the positions new in each response) and return_cumulative_logprob,
    streamed over gRPC and whole over the HTTP generate endpoint."""
    ids = random_ids(30, seed=9)
    want = LLM(model=tiny_dir, dtype="float32").generate(ids, SamplingParams(max_tokens=6, temperature=0,
                                                                             logprobs=2))[0]
    expected = [{str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                 for t, lp in position.items()} for position in want.logprobs]
    flags = dict(return_logprobs=True, return_cumulative_logprob=True)
    responses, error = collect(server, grpc_inputs(ids, {"max_tokens": 6, "temperature": 0, "logprobs": "2"},
                                                   **flags))
    assert error is None
    got = [json.loads(r["logprobs"][0]) for r in responses]
    assert [len(g) for g in got] == [len(r["output_ids"]) for r in responses]
    positions = [p for g in got for p in g]
    assert [p.keys() for p in positions] == [e.keys() for e in expected]
    assert all(abs(p[t]["logprob"] - e[t]["logprob"]) < 1e-4 and p[t]["rank"] == e[t]["rank"]
               for p, e in zip(positions, expected) for t in e)
    assert float(responses[-1]["cumulative_logprob"][0]) == pytest.approx(want.cumulative_logprob, abs=1e-3)
    plain, _ = collect(server, grpc_inputs(ids, {"max_tokens": 2}, **flags))       # not asked: null, NaN
    assert plain[-1]["logprobs"][0] == b"null" and math.isnan(float(plain[-1]["cumulative_logprob"][0]))
    status, body = triton_post(server, "/v2/models/llm/generate",
                        {"text_input": PROMPT, "exclude_input_in_output": True, "return_logprobs": True,
                         "sampling_parameters": json.dumps({"max_tokens": 5, "temperature": 0, "logprobs": 1})})
    assert status == 200 and len(json.loads(json.loads(body)["logprobs"])) == 5


def test_penalties_and_logit_bias_in_sampling_parameters(server, tiny_dir):
    """vLLM's keys, string values as Triton clients send them: the server decodes what the engine does."""
    ids = random_ids(30, seed=10)
    keys = {"frequency_penalty": 1.5, "repetition_penalty": 1.4, "logit_bias": {9: 2.0}}
    want = LLM(model=tiny_dir, dtype="float32").generate(ids, SamplingParams(max_tokens=10, temperature=0,
                                                                             ignore_eos=True, **keys))[0]
    sent = {"max_tokens": 10, "temperature": 0, "ignore_eos": True, "frequency_penalty": "1.5",
            "repetition_penalty": "1.4", "logit_bias": {"9": 2.0}}
    responses, error = collect(server, grpc_inputs(ids, sent))
    assert error is None and [int(i) for r in responses for i in r["output_ids"]] == want.token_ids


def test_n_sequences_carry_one_element_each(server, tiny_dir):
    """vllm_backend's n > 1: text_output, finish_reason, num_output_tokens, logprobs and cumulative_logprob have one
    element per sequence in every response; streamed, each response's elements are what each sequence gained."""
    ids = random_ids(50, seed=12)
    want = LLM(model=tiny_dir, dtype="float32").generate(ids, SamplingParams(
        n=3, max_tokens=6, temperature=1.0, seed=4, ignore_eos=True, logprobs=1))[0]
    sent = {"n": "3", "max_tokens": 6, "temperature": 1.0, "seed": 4, "ignore_eos": True, "logprobs": 1}
    flags = dict(return_finish_reason=True, return_num_output_tokens=True, return_cumulative_logprob=True,
                 return_logprobs=True)
    responses, error = collect(server, grpc_inputs(ids, sent, **flags))
    assert error is None and len(responses) == 18 and responses[-1]["final"]
    assert all(len(r[name]) == 3 for r in responses for name in ("text_output", "finish_reason",
                                                                  "num_output_tokens", "logprobs"))
    for i, seq in enumerate(want.outputs):
        assert "".join(r["text_output"][i].decode() for r in responses) == seq.text
        assert sum(int(r["num_output_tokens"][i]) for r in responses) == 6
        positions = [p for r in responses for p in json.loads(r["logprobs"][i])]
        assert [float(p[str(t)]["logprob"]) for p, t in zip(positions, seq.token_ids)] == \
            pytest.approx([p[t].logprob for p, t in zip(seq.logprobs, seq.token_ids)], abs=1e-4)
        assert float(responses[-1]["cumulative_logprob"][i]) == pytest.approx(seq.cumulative_logprob, abs=1e-3)
    assert [x.decode() for x in responses[-1]["finish_reason"]] == ["length"] * 3
    assert b"None" in responses[0]["finish_reason"]        # a sequence still running, as vllm_backend says it
    whole, error = collect(server, grpc_inputs(ids, sent, stream=False, **flags))
    assert error is None and len(whole) == 1
    assert [t.decode() for t in whole[0]["text_output"]] == [o.text for o in want.outputs]
    assert whole[0]["num_output_tokens"].tolist() == [6, 6, 6]
    assert whole[0]["output_ids"].tolist() == [t for o in want.outputs for t in o.token_ids]
    status, body = triton_post(server, "/v2/models/llm/generate",
                               {"input_ids": ids, "sampling_parameters": json.dumps(sent), "return_finish_reason": True,
                                "return_num_output_tokens": True})
    out = json.loads(body)
    assert status == 200 and out["text_output"] == [o.text for o in want.outputs]
    assert out["num_output_tokens"] == [6, 6, 6] and out["finish_reason"] == ["length"] * 3
    for bad, message in (({"n": 0}, "n: must be >= 1"), ({"n": "x"}, "n: expected an integer"),
                         ({"n": 64}, "n: 64 sequences exceed max_batch_size")):
        _, error = collect(server, grpc_inputs(ids, bad))
        assert error is not None and message in str(error)
    wait_until(lambda: scrape(server.metrics_url, "pagoda_kv_blocks", state="used") == 0, "the blocks to return")


def test_structured_outputs_in_sampling_parameters(server):
    """vllm_backend's keys: structured_outputs as a JSON string, the legacy guided_decoding; gRPC and HTTP."""
    import jsonschema
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    sent = {"max_tokens": 40, "seed": 3, "structured_outputs": json.dumps({"json": schema})}
    responses, error = collect(server, grpc_inputs(PROMPT, sent, return_finish_reason=True))
    assert error is None and responses[-1]["finish_reason"][0] == b"stop"
    jsonschema.validate(json.loads("".join(r["text_output"][0].decode() for r in responses)), schema)
    legacy = {"max_tokens": 10, "guided_decoding": json.dumps({"choice": ["left", "right"]})}
    status, body = triton_post(server, "/v2/models/llm/generate",
                               {"text_input": PROMPT, "exclude_input_in_output": True,
                                "sampling_parameters": json.dumps(legacy)})
    assert status == 200 and json.loads(body)["text_output"] in ("left", "right")
    for bad, message in (({"structured_outputs": '{"regex": "("}'}, "structured_outputs.regex: invalid regex"),
                         ({"structured_outputs": "{oops"}, "structured_outputs: not valid JSON"),
                         ({"guided_decoding": {"json": 5}}, "guided_decoding.json: expected a JSON schema")):
        _, error = collect(server, grpc_inputs(PROMPT, bad))
        assert error is not None and message in str(error), str(error)
    wait_until(lambda: scrape(server.metrics_url, "pagoda_kv_blocks", state="used") == 0, "the blocks to return")


def test_token_ids_input(server, tiny_dir):
    ids = random_ids(40, seed=3)
    responses, error = collect(server, grpc_inputs(ids, {"max_tokens": 5, "temperature": 0}))
    assert error is None
    expected = LLM(model=tiny_dir, dtype="float32").generate(ids, SamplingParams(max_tokens=5, temperature=0))[0]
    assert [int(i) for r in responses for i in r["output_ids"]] == expected.token_ids


def test_http_generate_and_sse(server, tiny_dir):
    expected = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
    status, body = triton_post(server, "/v2/models/llm/generate",
                        {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0}),
                         "exclude_input_in_output": True, "return_finish_reason": True})
    assert status == 200
    out = json.loads(body)
    assert out["text_output"] == expected.text and out["output_ids"] == expected.token_ids
    assert out["finish_reason"] == "length"
    status, body = triton_post(server, "/v2/models/llm/generate",
                        {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})})
    assert json.loads(body)["text_output"] == PROMPT + expected.text     # vLLM backend default: input prepended
    status, body = triton_post(server, "/v2/models/llm/generate_stream",
                        {"text_input": PROMPT, "stream": True,
                         "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})})
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith(b"data:")]
    assert len(events) == 8 and "".join(e["text_output"] for e in events) == expected.text
    result = stream_http(server.http_url, "llm", PROMPT, {"max_tokens": 8, "temperature": 0})
    assert result.ids == expected.token_ids and result.finish_reason == "length"


def test_bad_input_is_an_error_naming_the_field(server):
    responses, error = collect(server, grpc_inputs(PROMPT, {"max_tokens": -1}))
    assert error is not None and "max_tokens" in str(error)
    status, body = triton_post(server, "/v2/models/llm/generate",
                        {"text_input": PROMPT, "sampling_parameters": json.dumps({"temperature": -1})})
    assert status == 400 and "temperature" in json.loads(body)["error"]
    responses, error = collect(server, grpc_inputs(PROMPT, {"max_tokens": 3}))
    assert error is None and responses[-1]["final"]


def test_cancel_mid_stream_frees_blocks(server):
    baseline = scrape(server.metrics_url, "pagoda_kv_blocks", state="used")
    cancelled = scrape(server.metrics_url, "pagoda_requests_total", status="cancelled")
    responses, error = collect(server, grpc_inputs(random_ids(100, seed=9), {"max_tokens": 3000, "ignore_eos": True}),
                               cancel_after=5)
    assert len(responses) == 5 and error is None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if scrape(server.metrics_url, "pagoda_requests_total", status="cancelled") == cancelled + 1 and \
                scrape(server.metrics_url, "pagoda_kv_blocks", state="used") == baseline:
            break
        time.sleep(0.2)
    assert scrape(server.metrics_url, "pagoda_requests_total", status="cancelled") == cancelled + 1
    assert scrape(server.metrics_url, "pagoda_kv_blocks", state="used") == baseline
    responses, error = collect(server, grpc_inputs(PROMPT, {"max_tokens": 4}))
    assert error is None and len(responses) == 4


def test_stream_client(server):
    r = stream_grpc(server.grpc_url, "llm", PROMPT, {"max_tokens": 6, "temperature": 0})
    assert r.error is None and len(r.ids) == 6 and len(r.token_times) == 6 and r.ttft > 0
    cli = subprocess.run([sys.executable, "-m", "client.stream", "--prompt", PROMPT, "--max-tokens", "6",
                          "--url", server.grpc_url], capture_output=True, text=True, cwd=triton_server.ROOT)
    assert cli.returncode == 0 and "decode=" in cli.stdout and "finish_reason=length" in cli.stdout


def test_the_grpc_example_streams(server):
    """examples/triton_grpc_stream.py, as the README quotes it: some text, then whole blocks cached."""
    run = subprocess.run([sys.executable, "examples/triton_grpc_stream.py", "--url", server.grpc_url, "--prompt",
                          PROMPT], capture_output=True, text=True, cwd=triton_server.ROOT, timeout=120)
    end = re.search(r"\n\[finish_reason=(length|stop), cached_tokens=(\d+)\]\n$", run.stdout)
    assert run.returncode == 0 and end and end.start() > 0 and int(end[2]) % 32 == 0, run.stdout + run.stderr


def test_perf_analyzer_runs(server, tmp_path):
    data = {"data": [{"text_input": [PROMPT], "stream": [True], "exclude_input_in_output": [True],
                      "sampling_parameters": [json.dumps({"max_tokens": 8, "temperature": 0})]}]}
    (tmp_path / "input.json").write_text(json.dumps(data))
    for attempt in range(2):    # perf_analyzer 2.51 now and then exits 0 with its export empty (2 of ~10 suite runs)
        export = tmp_path / f"export{attempt}.json"     # a new path: it refuses one that exists
        run = subprocess.run([sys.executable, "-m", "scripts.perf_analyzer", "-m", "llm", "-x", "1", "-u",
                              server.grpc_url, "-i", "grpc",
                              "--streaming", "--input-data", str(tmp_path / "input.json"), "--measurement-mode",
                              "count_windows", "--measurement-request-count", "5", "--concurrency-range", "1",
                              "--stability-percentage", "1000", "--max-trials", "3",
                              "--profile-export-file", str(export)],
                             capture_output=True, text=True, cwd=triton_server.ROOT, timeout=300)
        said = run.stdout + run.stderr
        assert run.returncode == 0, said[:1500] + "\n...\n" + said[-1500:]
        assert "Request count" in run.stdout
        text = export.read_text()
        if text:
            break
    assert text, f"perf_analyzer exited 0 but wrote an empty {export.name}:\n{said[-3000:]}"
    requests = json.loads(text)["experiments"][0]["requests"]
    assert requests and all(len(r["response_timestamps"]) == 8 for r in requests)


def test_bare_config_is_auto_completed(tiny_dir, tmp_path):
    """A config.pbtxt naming only the backend gets its I/O and the decoupled policy from auto_complete_config."""
    model = tmp_path / "repo" / "llm"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text((triton_server.ROOT / "model_repository/llm/1/model.py").read_text())
    (model / "config.pbtxt").write_text('backend: "python"\ninstance_group [ { kind: KIND_CPU } ]\n')
    srv = triton_server.launch({"PAGODA_MODEL": tiny_dir, "PAGODA_DTYPE": "float32"}, tmp_path / "log.txt",
                               repository=model.parent)
    try:
        config = json.loads(urllib.request.urlopen(f"http://{srv.http_url}/v2/models/llm/config").read())
        assert config["model_transaction_policy"]["decoupled"] is True
        assert {i["name"] for i in config["input"]} >= {"text_input", "input_ids", "sampling_parameters", "stream"}
        responses, error = collect(srv, grpc_inputs(PROMPT, {"max_tokens": 3}))
        assert error is None and len(responses) == 3
    finally:
        assert srv.stop() == 0


def test_hit_miss_benchmarks_against_server(server, tmp_path):
    from perf import bench_serving as bench
    from perf import perf_hit_miss
    report = bench.main(["--url", server.grpc_url, "--metrics-url", server.metrics_url,
                         "--prompt-tokens", "80", "--max-tokens", "6", "--pairs", "2", "--concurrency", "1,2",
                         "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    for c in (1, 2):
        row = report["summary"][c]
        assert row["miss"]["n"] == 2 * c and row["hit"]["n"] == 2 * c
        assert row["miss"]["cached"] == 0 and row["hit"]["cached"] == 32      # 80 - 23 = 57 shared: one block
        assert row["hit"]["lookahead_steps"] > 0
    assert report["summary"][1]["hit"]["lookahead_steps"] == 4     # alone: 5 decode ticks, the first primes
    assert json.loads((tmp_path / "b.json").read_text())["samples"] and (tmp_path / "b.png").exists()
    assert all(s["engine_decode_tok_s"] > 0 and s["engine_cpu_ms"] > 0 for s in report["samples"])
    assert report["summary"][1]["engine_decode"]["pairs"] == 2
    pa = perf_hit_miss.main(["--url", server.grpc_url, "--prompt-tokens", "80", "--max-tokens", "5",
                             "--pairs", "2", "--warmup", "1", "--out", str(tmp_path / "pa")])
    assert len(pa["miss"]) == 2 and len(pa["hit"]) == 2
    assert [r["cached_tokens"] for r in pa["hit"]] == [32, 32], pa["hit"]
    assert [r["cached_tokens"] for r in pa["miss"]] == [0, 0], pa["miss"]
    assert all(r["engine_decode_tok_s"] > 0 for r in pa["miss"] + pa["hit"])      # perf_analyzer kept them
    assert pa["engine_decode"]["pairs"] == 2 and pa["client_decode"]["pairs"] == 2
