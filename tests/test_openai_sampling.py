"""vLLM's and OpenAI's sampling fields through the OpenAI-compatible server, with the official `openai` client:
logprobs, penalties, n, response_format and structured outputs, prompt_logprobs, bad_words, cache_salt."""
from __future__ import annotations

import json
import signal

import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tests.helpers import post, random_ids
from tests.helpers import start_openai as start

PROMPT = random_ids(70, seed=11)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    proc, url = start(tiny_dir, tmp_path_factory.mktemp("openai-sampling") / "server.log")
    yield url
    proc.terminate()
    assert proc.wait(30) in (0, -signal.SIGTERM)


def metric(url: str, name: str, **labels: str) -> float:
    from client.metrics import scrape
    return scrape(f"http://{url}/metrics", name, **labels)


def test_logprobs_with_the_openai_client(server, tiny_dir):
    """Completions' logprobs and chat's logprobs + top_logprobs, whole and streamed, through the official client;
    the values are the engine's (which equal transformers' log-softmax, tests/test_logprobs.py)."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://{server}/v1", api_key="none")
    want = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=6, temperature=0,
                                                                                logprobs=2))[0]
    sampled = [p[t].logprob for p, t in zip(want.logprobs, want.token_ids)]
    out = client.completions.create(model="tiny0", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(sampled, abs=1e-4) and len(lp.top_logprobs) == 6
    assert all(len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text
    chunks = list(client.completions.create(model="tiny0", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(sampled, abs=1e-4)
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="tiny0", messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)       # greedy: rank 1
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    stream = client.chat.completions.create(model="tiny0", messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c.logprob for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.completions.create(model="tiny0", prompt=PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    status, body = post(server, "/v1/chat/completions", {"model": "tiny0", "messages": messages, "top_logprobs": 2})
    assert status == 400 and body["error"]["param"] == "top_logprobs"


def test_penalties_with_the_openai_client(server, tiny_dir):
    """frequency_penalty and presence_penalty (OpenAI's fields) and repetition_penalty and min_p (vLLM's extra
    body) reach the sampler: the server decodes what the engine does with the same params."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://{server}/v1", api_key="none")
    args = dict(model="tiny0", prompt=PROMPT, max_tokens=12, temperature=0)
    plain = client.completions.create(**args).choices[0]
    out = client.completions.create(**args, frequency_penalty=1.5, presence_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.3, "ignore_eos": True}).choices[0]
    want = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(
        max_tokens=12, temperature=0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
        ignore_eos=True))[0]
    assert out.model_extra["token_ids"] == want.token_ids != plain.model_extra["token_ids"]
    biased = client.completions.create(**args, logit_bias={"7": 100}).choices[0]
    assert set(biased.model_extra["token_ids"]) == {7}


def test_n_choices_with_the_openai_client(server, tiny_dir):
    """n=3: three choices, each the engine's sequence (seeded: reproducible, sequence i seeded seed + i as vLLM
    does), whole and streamed, completions and chat; usage counts every choice's tokens."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://{server}/v1", api_key="none")
    args = dict(model="tiny0", prompt=PROMPT, max_tokens=7, temperature=1.0, seed=5, n=3,
                extra_body={"ignore_eos": True})
    out = client.completions.create(**args)
    want = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(
        n=3, max_tokens=7, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in out.choices] == [o.token_ids for o in want.outputs]
    assert [c.text for c in out.choices] == [o.text for o in want.outputs]
    assert out.usage.completion_tokens == 21 and client.completions.create(**args).choices == out.choices
    streamed: dict[int, list[int]] = {}
    finish = {}
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            finish[c.index] = c.finish_reason or finish.get(c.index)
        if chunk.usage:
            assert chunk.usage.completion_tokens == 21
    assert [streamed[i] for i in range(3)] == [o.token_ids for o in want.outputs]
    assert finish == {0: "length", 1: "length", 2: "length"}
    chat = client.chat.completions.create(model="tiny0", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=1)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content is not None for c in chat.choices)
    assert metric(server, "pagoda_kv_blocks", state="used") == 0


def test_response_format_with_the_openai_client(server, tiny_dir):
    """json_object and json_schema, chat and completions, whole and streamed: every output parses and validates."""
    import jsonschema
    from openai import OpenAI
    client = OpenAI(base_url=f"http://{server}/v1", api_key="none")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rain": {"type": "boolean"}}, "required": ["city", "rain"],
              "additionalProperties": False}
    as_schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "weather?"}]
    for seed in range(3):
        chat = client.chat.completions.create(model="tiny0", messages=messages, max_tokens=60, seed=seed,
                                              response_format=as_schema)
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        chunks = client.chat.completions.create(model="tiny0", messages=messages, max_tokens=60, seed=seed,
                                                response_format=as_schema, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), schema)
        done = client.completions.create(model="tiny0", prompt="x", max_tokens=60, seed=seed,
                                         extra_body={"structured_outputs": {"json": schema}})
        jsonschema.validate(json.loads(done.choices[0].text), schema)
    # any object: a random-weight model would fill a string to max_tokens; a bias towards '"' keeps strings short
    quote = Tokenizer(tiny_dir).encode('"')[0]
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        obj = client.chat.completions.create(model="tiny0", messages=messages, max_tokens=100, seed=seed,
                                             temperature=temperature, logit_bias={str(quote): 6},
                                             response_format={"type": "json_object"})
        assert obj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model="tiny0", prompt="x", max_tokens=10,
                                       extra_body={"guided_choice": ["red", "green"]})
    assert choice.choices[0].text in ("red", "green")
    status, body = post(server, "/v1/chat/completions", {"model": "tiny0", "messages": messages,
                                                         "response_format": {"type": "json_schema"}})
    assert status == 400 and body["error"]["param"] == "response_format"
    status, body = post(server, "/v1/completions", {"model": "tiny0", "prompt": "x", "guided_regex": "a("})
    assert status == 400 and body["error"]["param"] == "guided_regex", body


def test_prompt_logprobs_and_bad_words_through_the_server(server, tiny_dir):
    """vLLM's extra fields: prompt_logprobs per choice (completions) or on the response (chat), first chunk when
    streamed; bad_words and allowed_token_ids reach the sampler."""
    want = LLM(model=tiny_dir, dtype="float32").generate(PROMPT, SamplingParams(max_tokens=2, temperature=0,
                                                                                prompt_logprobs=1))[0]
    status, body = post(server, "/v1/completions", {"model": "tiny0", "prompt": PROMPT, "max_tokens": 2,
                                                    "temperature": 0, "prompt_logprobs": 1})
    got = body["choices"][0]["prompt_logprobs"]
    assert status == 200 and got[0] is None and len(got) == len(PROMPT)
    assert [got[i][str(PROMPT[i])]["logprob"] for i in range(1, len(PROMPT))] == pytest.approx(
        [want.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))], abs=1e-4)
    chat = {"model": "tiny0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    status, body = post(server, "/v1/chat/completions", chat)
    assert status == 200 and body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 1
    from openai import OpenAI
    client = OpenAI(base_url=f"http://{server}/v1", api_key="none")
    chunks = list(client.chat.completions.create(model="tiny0", messages=chat["messages"], max_tokens=3,
                                                 stream=True, extra_body={"prompt_logprobs": 0}))
    assert chunks[0].model_extra["prompt_logprobs"][0] is None
    assert all("prompt_logprobs" not in c.model_extra for c in chunks[1:])
    status, body = post(server, "/v1/completions", {"model": "tiny0", "prompt": PROMPT, "max_tokens": 6,
                                                    "temperature": 0, "allowed_token_ids": [11, 12]})
    assert status == 200 and set(body["choices"][0]["token_ids"]) <= {11, 12}


def test_cache_salt_separates_tenants(server):
    prompt = random_ids(80, seed=21)

    def cached(**salt):
        status, body = post(server, "/v1/completions", {"model": "tiny0", "prompt": prompt, "max_tokens": 2, **salt})
        assert status == 200
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached(cache_salt="a") == 0 and cached(cache_salt="b") == 0 and cached() == 0
    assert cached(cache_salt="a") > 0
