"""The engine's request API: stops, min_tokens, EOS, streaming deltas, validation, chat template."""
from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM
from tests.helpers import greedy, random_ids, step


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(model=tiny_dir, dtype="float32")



def stream(llm: LLM, prompt, params):
    eng = llm.engine
    req = eng.add(eng.make_request(prompt, params))
    deltas = []
    while eng.has_work:
        deltas += [d for d in step(eng) if d.request_id == req.id]
    return req, deltas


def test_the_last_delta_carries_the_engines_decode_timing(llm):
    """The engine's own view of a request's decode (first to last sampled token; its share of the decode ticks'
    CPU), on the last delta only, and observed into the per-request histograms."""
    m = llm.engine.metrics
    before = [m.value(f"{name}_count") for name in ("pagoda_decode_cpu_seconds_per_output_token",
                                                     "pagoda_time_per_output_token_seconds")]
    req, deltas = stream(llm, "A serving engine reads a prompt", greedy(12))
    assert all(d.decode_tok_s is None and d.decode_cpu_ms is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.decode_tok_s == pytest.approx(11 / (req.last_token_at - req.first_token_at))
    assert last.decode_cpu_ms == pytest.approx(1000 * req.decode_cpu / 11) and last.decode_cpu_ms > 0
    after = [m.value(f"{name}_count") for name in ("pagoda_decode_cpu_seconds_per_output_token",
                                                    "pagoda_time_per_output_token_seconds")]
    assert after == [b + 1 for b in before]
    _, one = stream(llm, "A serving engine reads a prompt", greedy(1))
    assert one[-1].decode_tok_s is None                  # one token: no decode to time


def test_stream_deltas_add_up(llm):
    req, deltas = stream(llm, "A serving engine reads a prompt", greedy(30))
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum((d.token_ids for d in deltas), []) == req.output_ids
    assert "".join(d.text for d in deltas) == req.text == llm.engine.tokenizer.decode(req.output_ids)
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 30


def test_stop_string_truncates_text(llm):
    full = llm.generate("The quick brown fox", greedy(40))[0].text
    clean = [i for i in range(8, len(full) - 2) if full[i:i + 2].isalpha()]
    stop = full[clean[0]:clean[0] + 2]
    req, deltas = stream(llm, "The quick brown fox", greedy(40, stop=[stop]))
    assert deltas[-1].finish_reason == "stop"
    assert req.text == full[:full.index(stop)]
    assert "".join(d.text for d in deltas) == req.text
    kept, deltas = stream(llm, "The quick brown fox", greedy(40, stop=[stop], include_stop_str_in_output=True))
    assert kept.text == full[:full.index(stop)] + stop and "".join(d.text for d in deltas) == kept.text


def test_special_tokens_are_skipped_unless_asked(llm):
    special = llm.engine.tokenizer.tok.token_to_id("<|im_start|>")
    forced = greedy(3, logit_bias={special: 100.0})                   # the model can only say <|im_start|>
    assert llm.generate("hi", forced)[0].text == ""
    kept = greedy(3, logit_bias={special: 100.0}, skip_special_tokens=False)
    assert llm.generate("hi", kept)[0].text == "<|im_start|>" * 3


def test_stop_token_and_eos(llm, tiny_dir, tmp_path):
    ids = llm.generate(random_ids(30, seed=1), greedy(20))[0].token_ids
    k = next(i for i in range(3, 20) if ids[i] not in ids[:i])
    out = llm.generate(random_ids(30, seed=1), greedy(20, stop_token_ids=[ids[k]], ignore_eos=False))[0]
    assert out.token_ids == ids[:k + 1] and out.finish_reason == "stop"
    model = shutil.copytree(tiny_dir, tmp_path / "model")       # the same weights, with ids[k] as the EOS
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[k]}))
    eos = LLM(model=str(model), dtype="float32")
    assert eos.generate(random_ids(30, seed=1), greedy(20, ignore_eos=False))[0].token_ids == ids[:k + 1]
    assert eos.generate(random_ids(30, seed=1), greedy(20))[0].token_ids == ids


def test_min_tokens_bans_stop_tokens(llm):
    ids = llm.generate(random_ids(30, seed=2), greedy(20))[0].token_ids
    out = llm.generate(random_ids(30, seed=2), greedy(20, min_tokens=12, stop_token_ids=[ids[1]], ignore_eos=False))[0]
    assert len(out.token_ids) >= 12
    assert ids[1] not in out.token_ids[:11]


@pytest.mark.parametrize("prompt,params,message", [
    ("", greedy(4, ignore_eos=False), "prompt: must not be empty"),
    ([], greedy(4, ignore_eos=False), "input_ids: must not be empty"),
    ([1, 5000], greedy(4, ignore_eos=False), "input_ids: token id 5000 is outside the vocabulary"),
    ([1, -3], greedy(4, ignore_eos=False), "input_ids: token id -3"),
    ([1, "a"], greedy(4, ignore_eos=False), "input_ids: token id 'a'"),
    ([1] * 4096, greedy(4, ignore_eos=False), "input_ids: 4096 tokens leave no room"),
    ([1] * 4000, greedy(200, ignore_eos=False), "max_tokens: prompt \\(4000\\) \\+ max_tokens \\(200\\) exceeds"),
])
def test_bad_requests_name_the_field(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.make_request(prompt, params)
    assert llm.generate("still serving", greedy(3, ignore_eos=False))[0].finish_reason in ("length", "stop")


def test_chat_template(llm):
    text = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = llm.engine.tokenizer.encode(text)
    assert ids[0] == llm.engine.tokenizer.tok.token_to_id("<|im_start|>")


def test_detokenizer_is_utf8_safe(llm):
    tok = llm.engine.tokenizer
    text = "naïve café 東京 你好世界 Привет"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert sum(1 for p in pieces if p == "") > 0      # multi-byte characters were held back, then emitted whole


def test_default_model_is_made_once(monkeypatch, tmp_path):
    from engine.config import cache_root
    kernels = cache_root() / "kernels"          # the session's compiled CPU kernels: only the model is made anew
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels)
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    first = LLM()
    path = tmp_path / "models" / "small-seed0" / "model.safetensors"
    assert first.engine.config.model == str(path.parent) and path.exists()
    stamp = path.stat().st_mtime_ns
    second = LLM(max_batch_size=1)
    assert path.stat().st_mtime_ns == stamp
    params = greedy(5, ignore_eos=False)
    assert first.generate("hello", params)[0].token_ids == second.generate("hello", params)[0].token_ids


def test_model_from_the_environment_unless_given(monkeypatch, tiny_dir, odd_dir):
    """LLM() takes PAGODA_MODEL as every option not given takes its PAGODA_ variable; LLM(model=...) wins."""
    monkeypatch.setenv("PAGODA_MODEL", tiny_dir)
    assert LLM(max_batch_size=1).engine.config.model == tiny_dir
    assert LLM(odd_dir, max_batch_size=1).engine.config.model == odd_dir


def test_deltas_leave_only_through_on_delta(tiny_dir):
    import pickle

    from engine.config import EngineConfig
    from engine.core.engine import Engine
    from engine.core.output import Delta
    engine = Engine(EngineConfig(model=tiny_dir, dtype="float32"))
    engine.add(engine.make_request("hello", greedy(3)))
    with pytest.raises(RuntimeError, match="set on_delta"):
        while engine.has_work:
            engine.step()
    got: list[Delta] = []
    engine.on_delta = got.append
    engine.add(engine.make_request("hello", greedy(3)))
    while engine.has_work:
        assert engine.step() is None
    assert got[-1].finished and sum(len(d.token_ids) for d in got if d.request_id == got[-1].request_id) == 3
    assert pickle.loads(pickle.dumps(got[-1])) == got[-1]       # the form it crosses the process boundary in
