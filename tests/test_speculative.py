"""N-gram speculative decoding end to end: greedy tokens equal to decoding without it across the sampling features,
paged and dense; sampled output distributed as without it; KV, prompt cache, metrics and the log line."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import random_ids

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
# a prompt that repeats itself: the random-weight model copies it back, so drafts are proposed and accepted
PROMPTS = [random_ids(30, seed=s) * 2 for s in range(3)]


def pair(tiny_dir, **kw) -> tuple[LLM, LLM]:
    base = {"model": tiny_dir, "dtype": "float32", "engine_process": False, **kw}
    return LLM(**base), LLM(**base, speculative_config=SPEC)


def accepted(llm: LLM) -> float:
    return llm.engine.metrics.spec_accepted._value.get()


# feature -> its sampling fields; with three allowed tokens the output repeats (drafts are taken) while the
# penalties' counts decide, token by token, which of them comes next
THREE = {"allowed_token_ids": [5, 6, 7]}
FEATURES = {
    "plain": {},
    "frequency penalty": {"frequency_penalty": 0.02, **THREE},
    "all penalties": {"frequency_penalty": 0.01, "presence_penalty": 0.01, "repetition_penalty": 1.01, **THREE},
    "strong penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2},
    "logit bias": {"logit_bias": {7: 3.0}},
    "min_tokens and stop tokens": {"min_tokens": 12, "stop_token_ids": [52, 499], "ignore_eos": False},
    "bad words": {"bad_words": ["the cat"]},
    "allowed tokens": {"allowed_token_ids": list(range(3, 600))},
    "stop string": {"stop": ["e"]},
    "max_tokens inside a run": {"max_tokens": 23},
    "structured output": {"structured_outputs": {"choice": ["yes", "no"]}},
    "structured output, drafted": {"structured_outputs": {"regex": "[^Z]*"}},    # a prompt's drafts cut at its Z
}
UNDRAFTED = ("strong penalties", "stop string", "structured output")     # no accepted run to check there


def chained(llm: LLM) -> LLM:
    """Verify steps launched from the step in flight, as on a GPU (a CPU step does not overlap the host)."""
    llm.engine.spec.chain = True
    return llm


@pytest.fixture(scope="module", params=["paged", "dense", "paged, chained", "dense, chained"])
def engines(request, tiny_dir):
    off, on = pair(tiny_dir, **({"max_batch_size": 1} if "dense" in request.param else {}))
    return off, chained(on) if "chained" in request.param else on


@pytest.mark.parametrize("feature", FEATURES)
def test_greedy_tokens_equal_speculation_off(engines, feature):
    off, on = engines
    params = SamplingParams(**{"max_tokens": 40, "temperature": 0.0, "ignore_eos": True, **FEATURES[feature]})
    before = accepted(on)
    want, got = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    if feature not in UNDRAFTED:
        assert accepted(on) > before                    # drafts were verified and taken, not only proposed


def test_the_proposer_matches_the_tokenizer_blanks_loosely(engines):
    _, on = engines
    blanks = on.engine.spec.blanks
    assert blanks is not None and blanks.widths.keys() == on.engine.tokenizer.layout()[0].keys() != set()


def test_blanks_are_drafted_loosely_and_decode_as_without(tiny_dir, monkeypatch):
    """Lines indented by spaces and by tabs, the output held to those tokens: the proposer matches a tab for a space
    (Lookup._align runs on such matches) and greedy output stays what it is without speculation."""
    from engine.core.ngram import Lookup
    aligned = []
    align = Lookup._align
    monkeypatch.setattr(Lookup, "_align", lambda self, *a: aligned.append(a) or align(self, *a))
    off, on = pair(tiny_dir)
    tok = on.engine.tokenizer
    allowed = sorted({tok.encode(c)[0] for c in (" ", "\t", "\n", "x")})
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)
    prompt = "x\n x\n\tx\n  x\n \tx\n" * 3
    assert [o.token_ids for o in on.generate(prompt, params)] == [o.token_ids for o in off.generate(prompt, params)]
    assert aligned


def test_a_draft_row_is_masked_as_if_the_drafts_before_it_were_output(tiny_dir):
    """A verify row past drafts d[:j] gets the mask of a matcher that took d[:j]; the sequence's matcher is left at
    its committed tokens; a draft is cut where the grammar refuses it."""
    import xgrammar as xgr

    from engine.core.structured import StructuredOutputs
    llm = LLM(model=tiny_dir, dtype="float32", engine_process=False)
    grammars = llm.engine.intake._grammars()
    compiled = grammars.compile(StructuredOutputs.parse({"json": {
        "type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}}))
    ids = llm.engine.tokenizer.encode('{"count": 42')
    seq, ref = grammars.matcher(compiled), grammars.matcher(compiled)
    assert seq.legal(ids + ids) == len(ids)              # a second '{' cannot follow a number
    vocab = llm.engine.runner.vocab_size
    masks = []
    for j in range(len(ids) + 1):
        got, want = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
        seq.ahead(ids[:j]).fill(got, 0)
        ref.fill(want, 0)
        assert torch.equal(got, want), j
        masks.append(got)
        if j < len(ids):
            assert ref.accept(ids[j])
    assert not torch.equal(masks[0], masks[-1])
    assert seq.legal(ids) == len(ids) and seq.accept(ids[0])    # untouched: still at the start


def test_every_max_tokens_ends_where_it_would(engines):
    off, on = engines
    for n in range(1, 30, 2):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert [o.token_ids for o in on.generate(PROMPTS, params)] == \
            [o.token_ids for o in off.generate(PROMPTS, params)], n


def test_logprobs_of_every_emitted_token(engines):
    off, on = engines
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3)
    for want, got in zip(off.generate(PROMPTS, params), on.generate(PROMPTS, params)):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
        assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-3


def test_n_choices_and_the_prompt_cache(tiny_dir):
    off, on = pair(tiny_dir)
    params = SamplingParams(n=2, max_tokens=30, temperature=0.0, ignore_eos=True)
    first = on.generate(PROMPTS[:1], params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in off.generate(PROMPTS[:1], params)[0].outputs]
    # the same prompt again: a hit on the blocks the first run registered, and every block given back after
    again = on.generate(PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert again.cached_tokens > 0 and again.token_ids == first.outputs[0].token_ids
    stats = on.engine.kv.stats()
    assert stats["used"] == 0


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of equal distributions over the same cells: the p-value."""
    na, nb = sum(a), sum(b)
    stat, cells = 0.0, 0
    for x, y in zip(a, b):
        if x + y:
            cells += 1
            ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
            stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return float(1 - torch.special.gammainc(torch.tensor((cells - 1) / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("mode", ["sync", "chained"])
def test_sampled_output_is_distributed_as_without_speculation(tiny_dir, mode, monkeypatch):
    """Temperature 1, top-k 4, seeded per request (so the test is deterministic): the joint distribution of three
    tokens with speculation equals the one without (chi-square, p > 0.001). The prompt's continuation is biased
    into the top tokens, so the draft is taken about half the time; a presence penalty makes each token depend on
    the ones before it, so a step that kept a row sampled after a rejected draft (from the wrong context) fails
    here (p ~ 1e-7). Chained: a request drafts only with a step in flight, so the verify step after it launches
    while that step is in flight, its drafts following a guess of that step's token; the last three of 4 tokens."""
    from engine.core.speculate import Speculator
    off, on = pair(tiny_dir, max_batch_size=2)         # room in a step of 8 rows for drafts
    n, guesses = (3, None) if mode == "sync" else (4, [])
    if guesses is not None:
        chained(on)
        ready, drafts = Speculator.ready, Speculator.drafts
        monkeypatch.setattr(Speculator, "ready", lambda self, batch: [r for r in ready(self, batch)
                                                                     if r.in_flight])

        def guessed(*a):
            found = drafts(*a)
            guesses.extend(g for g, _ in found.values() if g >= 0)
            return found
        monkeypatch.setattr(Speculator, "drafts", guessed)
    prompt = PROMPTS[0]
    follow = prompt[30:30 + n]                  # what the n-gram lookup proposes after the prompt's last tokens
    counts = []
    for llm in (off, on):
        before = accepted(llm)
        params = [SamplingParams(max_tokens=n, temperature=1.0, top_k=4, seed=s, ignore_eos=True, presence_penalty=2.0,
                                 logit_bias={t: 4.0 for t in follow}) for s in range(600)]
        outs = [tuple(o.token_ids[-3:]) for o in llm.generate([prompt] * 600, params)]
        counts.append({c: outs.count(c) for c in set(outs)})
        if llm is on:
            assert accepted(llm) > before
    assert guesses is None or len(guesses) > 100
    cells = sorted(set(counts[0]) | set(counts[1]))
    assert chi_square_p([counts[0].get(c, 0) for c in cells], [counts[1].get(c, 0) for c in cells]) > 0.001


@pytest.mark.parametrize("mode", ["sync", "chained"])
def test_seeded_requests_reproduce(tiny_dir, mode):
    _, on = pair(tiny_dir)
    on = chained(on) if mode == "chained" else on
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    assert [o.token_ids for o in on.generate(PROMPTS, params)] == [o.token_ids for o in on.generate(PROMPTS, params)]


def test_metrics_and_the_log_line(tiny_dir, caplog):
    _, on = pair(tiny_dir)
    with caplog.at_level(logging.INFO, logger="pagoda"):
        on.generate(PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    m = on.engine.metrics
    drafted, taken = m.spec_draft_tokens._value.get(), m.spec_accepted._value.get()
    per_pos = [m.spec_per_pos.labels(position=str(i))._value.get() for i in range(SPEC["num_speculative_tokens"])]
    assert 0 < taken <= drafted and sum(per_pos) == taken and per_pos == sorted(per_pos, reverse=True)
    text = m.text().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "pagoda_spec_decode_accepted_tokens_total"):
        assert name in text
    line = next(r.getMessage() for r in caplog.records if "request completed" in r.getMessage())
    assert f"accepted={int(taken)}/{int(drafted)}" in line


def test_a_bad_config_is_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(model=tiny_dir, engine_process=False, speculative_config={"method": "eagle", "num_speculative_tokens": 2})


@pytest.mark.parametrize("runner", ["triton", "mlx"])
def test_verify_rows_on_the_other_decode_paths(tiny_dir, runner):
    """Triton's decode kernels (under the interpreter here) and the MLX runner take a sequence's verify rows too."""
    if runner == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed")
        kw = {"runner": "mlx"}
    else:
        pytest.importorskip("triton", reason="triton is not installed (Linux only)")
        kw = {"attention": "triton", "block_size": 16}
    off, on = pair(tiny_dir, **kw)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)       # (the interpreter is slow)
    assert on.generate(PROMPTS[:1], params)[0].token_ids == off.generate(PROMPTS[:1], params)[0].token_ids
    assert accepted(on) > 0


@pytest.mark.parametrize("mode", ["sync", "chained"])
def test_cancelled_and_preempted_requests_give_every_block_back(tiny_dir, mode):
    """A pool too small for the batch preempts; a cancel lands between verify steps; every block comes back."""
    from engine.config import EngineConfig
    from engine.core.engine import Engine
    engine = Engine(EngineConfig(model=tiny_dir, dtype="float32", block_size=16, num_kv_blocks=14,
                                 speculative_config=SPEC))
    engine.spec.chain = mode == "chained"
    done = []
    engine.on_delta = lambda d: done.append(d) if d.finished else None
    reqs = [engine.add(engine.make_request(p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)))
            for p in PROMPTS]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 6:
            engine.abort(reqs[1].id)
    assert sorted(d.finish_reason for d in done) == ["abort", "length", "length"]
    assert engine.metrics.preemptions._value.get() > 0 and accepted_of(engine) > 0
    assert engine.kv.stats()["used"] == 0


def accepted_of(engine) -> float:
    return engine.metrics.spec_accepted._value.get()


def test_chained_verify_steps_keep_the_overlap(tiny_dir, monkeypatch):
    """Launched from the step in flight, verify steps keep lookahead's overlap (its counter counts them), where a
    CPU's verify steps read the step in flight first. Drafts that followed a wrong guess of the token in flight, and
    steps launched after drafts that were then rejected, are void: the tokens stay those of speculation off."""
    from engine.core import speculate
    from engine.core.lookahead import Lookahead
    guesses, void = [], []

    def checked(spans):
        guesses.extend(speculate._token(s.req, s.start) == s.guess for s in spans
                       if s.guess >= 0 and s.start < s.req.seq_len)

    def accept(self, eng, span, *a):
        checked([span])
        return real_accept(self, eng, span, *a)

    def settle(self, eng):
        checked(eng.lookahead.inflight.spans if eng.lookahead.inflight else [])
        return real_settle(self, eng)

    def read(self, step):
        void.extend(s for s in (step.spans if step else []) if s.req.num_computed != s.start and not s.req.finished)
        return real_read(self, step)

    real_accept, real_settle, real_read = speculate.Speculator.accept, speculate.Speculator.settle, Lookahead._read
    monkeypatch.setattr(speculate.Speculator, "accept", accept)
    monkeypatch.setattr(speculate.Speculator, "settle", settle)
    monkeypatch.setattr(Lookahead, "_read", read)
    off, sync = pair(tiny_dir)
    on = chained(pair(tiny_dir)[1])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in off.generate(PROMPTS, params)]
    share = {}
    for name, llm in (("sync", sync), ("chained", on)):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        m = llm.engine.metrics
        assert accepted(llm) > 0
        share[name] = llm.engine.lookahead.pipelined / m.value("pagoda_decode_steps_total")
    assert share["chained"] > 0.9 and share["sync"] < 0.75, share
    assert True in guesses and False in guesses and void
