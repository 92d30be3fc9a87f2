"""SamplingParams validation and the sampling ops."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runners.base import Row
from engine.runners.torch import sampler
from engine.runners.torch.sampler import draw, nucleus, sample, sample_one
from tests.helpers import random_ids


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "abc"}, "max_tokens"), ({"max_tokens": [3]}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": ["a", 3]}, "stop"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"bogus": 1}, "bogus"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams.from_dict(kwargs)


def test_from_json_accepts_strings():
    p = SamplingParams.from_json('{"max_tokens": "16", "temperature": "0", "top_k": "5", "ignore_eos": "true", '
                                 '"stop": "END"}')
    assert (p.max_tokens, p.temperature, p.top_k, p.ignore_eos, p.stop) == (16, 0.0, 5, True, ["END"])
    assert p.greedy
    with pytest.raises(ValueError, match="^sampling_parameters: not valid JSON"):
        SamplingParams.from_json("{nope")
    with pytest.raises(ValueError, match="^sampling_parameters: must be a JSON object"):
        SamplingParams.from_json("[1, 2]")


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0])
    gen = torch.Generator().manual_seed(0)
    k2 = {int(sample_one(logits, SamplingParams(top_k=2), gen)) for _ in range(200)}
    assert k2 == {0, 1}
    # softmax mass: ~0.665, 0.245, 0.09: top_p 0.8 keeps the first two
    p8 = {int(sample_one(logits, SamplingParams(top_p=0.8), gen)) for _ in range(300)}
    assert p8 == {0, 1}


@pytest.mark.parametrize("block", [512, 2, 4])     # one scan; blocks of 2 (one all zeros, a tail) and 4
def test_draws_follow_the_distribution_and_never_pick_a_zero(block, monkeypatch):
    monkeypatch.setattr(sampler, "DRAW_BLOCK", block)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 0.0, 0.0, 0.0]) * 3     # unnormalised, zeros at both ends
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([draw(probs, gen) for _ in range(6000)]), minlength=9).float()
    assert counts[[0, 2, 5, 6, 7, 8]].sum() == 0
    assert torch.allclose(counts / 6000, probs / probs.sum(), atol=0.025)
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert [int(draw(probs, a)) for _ in range(8)] == [int(draw(probs, b)) for _ in range(8)]


@pytest.mark.parametrize("spread", [0.5, 2.0, 8.0])        # flat: the cut past the first tokens; peaked: among them
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_the_nucleus_is_what_sorting_the_whole_vocabulary_keeps(spread, top_p, monkeypatch):
    monkeypatch.setattr(sampler, "NUCLEUS_FIRST", (16, 64))
    probs = (torch.randn(5000, generator=torch.Generator().manual_seed(int(spread * 10))) * spread).softmax(-1)
    ordered, order = torch.sort(probs, descending=True)
    drop = ordered.cumsum(-1) - ordered > top_p
    want = torch.ones(5000, dtype=torch.bool).index_fill_(0, order[drop], False)
    kept, ids = nucleus(probs, top_p)
    assert torch.equal(torch.zeros(5000, dtype=torch.bool).index_fill_(0, ids[kept > 0], True), want)
    assert torch.equal(kept[kept > 0], probs[ids[kept > 0]]) and 1 <= int((kept > 0).sum()) < 5000
    assert bool((probs[ids][:-1] >= probs[ids][1:]).all())


def test_ban_masks_tokens():
    logits = torch.tensor([[1.0, 9.0, 2.0]])
    rows = [Row(0, 0, [1], params=SamplingParams(temperature=0), ban=(1,))]
    assert sample(logits, rows, lambda r: None).tolist() == [2]


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate(random_ids(30, seed=1), p)[0].token_ids
    batch = llm.generate([random_ids(30, seed=1), random_ids(25, seed=2)],
                         [p, SamplingParams(max_tokens=20, temperature=1.0, seed=7)])[0].token_ids
    sync = LLM(model=tiny_dir, dtype="float32", lookahead=False).generate(random_ids(30, seed=1), p)[0].token_ids
    assert alone == batch == sync
    other = llm.generate(random_ids(30, seed=1), SamplingParams(max_tokens=20, temperature=1.0, seed=43,
                                                                ignore_eos=True))[0].token_ids
    assert other != alone


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_top_k_draws_from_the_renormalised_k_most_likely(top_p):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 2
    p = SamplingParams(temperature=0.7, top_k=6, top_p=top_p)
    want = (logits / 0.7).masked_fill(logits < torch.topk(logits, 6).values[-1], float("-inf")).softmax(-1)
    ordered, order = torch.sort(want, descending=True)
    want[order[ordered.cumsum(-1) - ordered > top_p]] = 0
    want /= want.sum()
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([sample_one(logits, p, gen) for _ in range(5000)]), minlength=1000)
    assert set(counts.nonzero().flatten().tolist()) == set(want.nonzero().flatten().tolist())
    assert torch.allclose(counts / 5000, want, atol=0.025)
    tied = torch.tensor([3.0, 1.0, 2.0, 2.0, -1.0])          # the 2nd most likely ties with the 3rd: both stay
    assert {int(sample_one(tied, SamplingParams(top_k=2), gen)) for _ in range(300)} == {0, 2, 3}


def test_a_row_with_every_token_masked_is_an_error_not_a_token():
    with pytest.raises(ValueError, match="^sampling: every token is masked"):
        draw(torch.full((2000,), float("nan")), torch.Generator().manual_seed(0))
    logits = torch.full((2000,), float("-inf"))
    with pytest.raises(ValueError, match="^sampling: every token is masked"):
        sample_one(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
