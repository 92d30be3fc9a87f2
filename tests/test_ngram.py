"""N-gram speculation's configuration (vLLM's speculative_config) and its prompt-lookup proposer."""
from __future__ import annotations

import random

import pytest

from engine.core.ngram import Blanks, Lookup, NgramConfig
from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.core.speculate import MAX_SKIP, Costs, Pace, Speculator


def brute(ids: list[int], low: int, high: int, k: int, blank: frozenset[int] = frozenset()) -> list[int]:
    """The definition: the longest n in [low, high] whose last-n tokens occur earlier (exactly, or else with any
    `blank` for any other: an exact occurrence first at a length); what followed their latest occurrence, read on
    past the sequence's end as the sequence repeating from there; for an exact one that occurred before that too,
    only as far as what followed both is the same."""
    def norm(seq):
        return [-1 if t in blank else t for t in seq]
    for n in range(min(high, len(ids) - 1), low - 1, -1):
        suffix = ids[-n:]
        for exact, same in ((True, lambda a: a == suffix), (False, lambda a: norm(a) == norm(suffix))):
            ends = [end for end in range(len(ids) - 2, n - 2, -1) if same(ids[end + 1 - n:end + 1])]
            if ends:
                end, seq = ends[0], list(ids)
                for i in range(k):
                    seq.append(seq[end + 1 + i])
                out = seq[end + 1:end + 1 + k]
                if exact and len(ends) > 1:
                    prior = ends[1]
                    out = out[:next((i for i in range(min(k, len(ids) - end - 1))
                                     if ids[prior + 1 + i] != ids[end + 1 + i]), k)]
                return out
    return []


def test_proposals_match_the_definition_as_the_sequence_grows():
    rng = random.Random(0)
    for low, high in ((1, 1), (2, 4), (3, 5)):
        prompt = [rng.randrange(6) for _ in range(60)]
        lookup, output = Lookup(NgramConfig(4, low, high)), []
        for _ in range(80):
            assert lookup.propose(prompt, output, 4) == brute(prompt + output, low, high, 4)
            output += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]      # 1 to 3 tokens a step


def test_a_copied_passage_is_proposed_and_nothing_without_a_match():
    passage = list(range(100, 140))
    lookup = Lookup(NgramConfig(5, 2, 3))
    assert lookup.propose(passage + [1, 2], passage[:3], 5) == passage[3:8]
    assert Lookup(NgramConfig(5, 2, 3)).propose(list(range(50)), [], 5) == []
    assert Lookup(NgramConfig(5, 1, 2)).propose([3, 7, 7, 7], [], 4) == [7, 7, 7, 7]    # a run goes on
    assert Lookup(NgramConfig(5, 2, 2)).propose([1, 2, 3, 1, 2], [], 5) == [3, 1, 2, 3, 1]     # with its period


def test_blanks_match_any_blank_as_the_definition_says():
    rng = random.Random(1)
    blanks = Blanks.of({4: "\t", 5: "\t\t"})           # tabs: matched loosely, never re-indented
    for low, high in ((1, 1), (2, 4), (3, 5)):
        prompt = [rng.randrange(6) for _ in range(60)]
        lookup, output = Lookup(NgramConfig(4, low, high), blanks), []
        for _ in range(80):
            assert lookup.propose(prompt, output, 4) == brute(prompt + output, low, high, 4, frozenset({4, 5}))
            output += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_a_proposal_stops_where_two_occurrences_part():
    # "if the prompt is a <word>, then the answer": after "is a", the word is a guess between the two before
    prompt = [1, 2, 3, 10, 4, 5, 6, 7, 1, 2, 3, 11, 4, 5, 6, 7]
    assert Lookup(NgramConfig(5, 2, 3)).propose(prompt, [9, 1, 2, 3], 5) == []
    # after the word, ", then" follows both, and then one goes on with the output (9), the other with 1
    assert Lookup(NgramConfig(5, 2, 3)).propose(prompt, [9, 1, 2, 3, 12, 4, 5], 4) == [6, 7]
    # parting later: as far as both agree
    assert Lookup(NgramConfig(5, 2, 2)).propose([1, 2, 3, 4, 5, 1, 2, 3, 4, 6], [1, 2], 5) == [3, 4]
    # once: what followed it, as before
    assert Lookup(NgramConfig(5, 2, 2)).propose([1, 2, 3, 4, 5], [1, 2], 5) == [3, 4, 5, 1, 2]


def test_code_re_indented_is_proposed_with_the_output_indentation():
    """A method lifted out of its class: the prompt's lines at 8 and 12 columns come out at 4 and 8. Exactly,
    nothing past a line's indentation matches; loosely, the line goes on, and its next lines' indentation is the
    prompt's moved by the 4 columns the output has moved it (a space inside a line stays; a line at 4 columns goes
    to the margin, without a blank)."""
    nl, sp, s4, s5, s8, s12 = 9, 5, 1, 6, 2, 3
    blanks = Blanks.of({sp: " ", s4: "    ", s5: " " * 5, s8: "        ", s12: " " * 12}, frozenset({nl}))
    prompt = [50, 51, nl, s8, 60, 61, 62, nl, s12, 70, 71, nl, s8, 80, 81, nl]
    output = [60, 61, 62, nl, s8, 70]                  # the output's first line was at 4 columns, this one at 8
    assert Lookup(NgramConfig(6, 2, 3)).propose(prompt, output, 6) == []
    lookup = Lookup(NgramConfig(6, 2, 3), blanks)
    assert lookup.propose(prompt, output, 6) == [71, nl, s4, 80, 81, nl]
    assert lookup.shift == -4
    assert lookup.propose(prompt, output + [71, nl, s4, 80], 2) == [81, nl]     # exact again, still shifted
    again = output + [71, nl, s4, 80, 81, nl, s8, 90, 91, nl, s8, 92, nl, s8, 90]   # its own text: taken as it is
    assert lookup.propose(prompt, again, 3) == [91, nl, s8] and lookup.shift == -4
    level = Lookup(NgramConfig(4, 2, 3), blanks)        # indented as the prompt: nothing moves
    assert level.propose(prompt, [nl, s12, 70], 4) == [71, nl, s8, 80] and level.shift == 0
    inner = [40, nl, s4, 41, 42, sp, 43, nl, s8, 44, nl, s4, 45, sp, 46, nl]
    deeper = Lookup(NgramConfig(8, 2, 3), blanks)       # moved in by 4: a space inside a line is no indentation
    assert deeper.propose(inner, [41, 42, sp, 43, nl, s12, 44], 8) == [nl, s8, 45, sp, 46, nl, 41, 42]
    assert deeper.shift == 4
    shallow = Lookup(NgramConfig(5, 2, 3), blanks)      # moved out by 4: the line at 4 columns loses its blank
    assert shallow.propose(inner, [41, 42, sp, 43, nl, s4, 44], 5) == [nl, 45, sp, 46]


@pytest.mark.parametrize("value,config", [
    ({"method": "ngram", "num_speculative_tokens": 4}, NgramConfig(4, 5, 5)),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}', NgramConfig(3, 4, 4)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
     NgramConfig(3, 2, 4)),
    (None, None), ({}, None),
])
def test_config_as_vllm_reads_it(value, config):
    assert NgramConfig.parse(value) == config


@pytest.mark.parametrize("value,why", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method: only"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens: needed"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: expected an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model: not supported"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min: 4 is above"),
    ("{nope", "speculative_config: not valid JSON"),
])
def test_bad_config_names_the_key(value, why):
    with pytest.raises(ValueError, match=why):
        NgramConfig.parse(value)


def test_a_row_pays_at_a_bar_that_rises_with_the_step():
    """The row that makes a step w rows pays when its chance of being taken covers what it adds against what the
    step yields without it: a row's cost for a first draft at concurrency 1, more in a wider step, more again past
    the runner's cheap rows; cheaper rows (as a runner may time them) lower every bar; a float CPU's pass of 8 rows
    takes no draft past them."""
    bars = [Costs(4).worth(w) for w in range(2, 33)]
    assert bars[0] == pytest.approx(Costs(4).row) and bars == sorted(set(bars)) and bars[-1] < 1
    assert Costs(4).worth(5) - Costs(4).worth(4) > Costs(4).worth(4) - Costs(4).worth(3)
    timed = Costs(4, row=0.09, late=0.13)
    assert all(timed.worth(w) < bar for w, bar in zip(range(2, 33), bars))
    assert Pace(hits=8).length(8, 4, timed) > Pace(hits=8).length(8, 4, Costs(4))     # concurrency 4, drafts taken
    drawn = Costs(4, row=0.09, late=0.13, sampled=0.08)       # a row drawn at a temperature costs its draw too
    assert all(drawn.worth(w, True) > drawn.worth(w) == timed.worth(w) for w in range(2, 33))
    full = Speculator(NgramConfig(4, 1, 1), rows=8, costs=Costs(8))
    assert full.pays(7) and not full.pays(8)


def unguessed(found: dict[int, tuple[int, list[int]]]) -> dict[int, list[int]]:
    """Drafts that follow the committed tokens (no step in flight): no guess."""
    assert all(guess == -1 for guess, _ in found.values())
    return {i: draft for i, (_, draft) in found.items()}


def test_drafts_are_as_long_as_they_pay():
    """A first draft is a one-token probe; drafts grow while they are taken (each token while its chance of being
    reached and taken is at least the bar of the step it widens), shrink as the step widens, stop where no row
    pays and at the rows a step takes; rounds below the bar make the sequence skip the next 1, 2, 4 ... chances
    (up to MAX_SKIP), then probe again. Past the runner's cheap rows a sequence probes no more: it drafts only what
    its rate says pays there."""
    spec = Speculator(NgramConfig(4, 1, 1), rows=32, costs=Costs(8))
    req = Request(1, [5, 6, 7, 8, 9, 10, 11], SamplingParams())
    req.output_ids = [5, 6]
    assert unguessed(spec.drafts(spec.ready([req]), 1, {1: 10})) == {1: [7]}
    lengths = []
    for _ in range(5):
        spec.record(req, 4, 4, Costs(8).worth(2))
        lengths.append(spec.paces[1].length(4, 1, Costs(8)))
    assert lengths == sorted(lengths) and lengths[-1] == 4 and lengths[-1] > Pace().length(4, 1, Costs(8))
    assert unguessed(spec.drafts(spec.ready([req]), 1, {1: 10})) == {1: [7, 8, 9, 10]}
    widths = [len(unguessed(spec.drafts([req], w, {1: 10})).get(1, [])) for w in (1, 4, 6, 7, 8)]
    assert widths == sorted(widths, reverse=True) and widths[0] == 4 and widths[-2] == 1 and widths[-1] == 0
    probe = Speculator(NgramConfig(4, 1, 1), rows=32, costs=Costs(8))
    assert unguessed(probe.drafts([req], 7, {1: 10})) == {1: [7]}     # a probe
    late = Speculator(NgramConfig(4, 1, 1), rows=32, costs=Costs(4))       # past the cheap rows: no probe, a sure draft
    assert late.drafts([req], 4, {1: 10}) == {} and unguessed(late.drafts([req], 3, {1: 10})) == {1: [7]}
    late.paces = spec.paces
    assert unguessed(late.drafts([req], 4, {1: 10}))[1][0] == 7
    narrow = Speculator(NgramConfig(4, 1, 1), rows=3, costs=Costs(8))
    narrow.paces = spec.paces
    assert unguessed(narrow.drafts([req], 1, {1: 10})) == {1: [7, 8]}      # two rows to spare in a pass of 3
    assert unguessed(spec.drafts([req], 1, {1: 2})) == {1: [7, 8]}         # two tokens left before max_tokens
    skips = []
    for _ in range(40):
        spec.record(req, 1, 0, Costs(8).worth(2))
        skipped = 0
        while not spec.ready([req]):
            skipped += 1
        skips.append(skipped)
    skips = [n for n in skips if n]         # rounds while the rate was still above the bar skip nothing
    assert skips[:6] == [1, 2, 4, 8, 16, MAX_SKIP] and set(skips[6:]) == {MAX_SKIP}
    assert spec.paces[1].rate < Costs(8).worth(2)


def test_a_row_drawn_at_a_temperature_pays_for_its_draw():
    """Past the cheap rows, an acceptance rate that pays for a greedy request's draft does not pay for a request
    drawn at a temperature, whose row adds its draw to the step: that one proposes without a row (a shadow)."""
    costs = Costs(4, row=0.09, late=0.13, sampled=0.08)
    rate = (costs.worth(5) + costs.worth(5, True)) / 2
    for params, drafts in ((SamplingParams(temperature=0), True), (SamplingParams(temperature=0.8), False)):
        spec = Speculator(NgramConfig(4, 1, 1), rows=32, costs=costs)
        req = Request(1, [5, 6, 7, 8, 9, 10, 11], params)
        req.output_ids = [5, 6]
        spec.paces[1] = Pace(hits=(3 * rate - 1) / (1 - rate), misses=1)
        assert spec.paces[1].rate == pytest.approx(rate)
        found = spec.drafts([req], 4, {1: 10})
        assert (found == {1: (-1, [7])}) == drafts and (1 in spec.shadows) != drafts


def test_past_the_cheap_rows_shadow_drafts_earn_a_record():
    """Past the runner's cheap rows a sequence without a record drafts nothing: it proposes without verifying (no
    row), and once decoding has sampled that position the proposal counts as a token taken or not. Taken ones raise
    its rate until a draft pays there; a refused one lowers it. None is a draft for the metrics or the backoff, none
    is proposed behind drafts in flight, and a verify step's record replaces a pending one."""
    spec = Speculator(NgramConfig(4, 1, 1), rows=32, costs=Costs(4))
    req = Request(1, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], SamplingParams())
    req.output_ids = [5, 6]
    rounds = 0
    while not (found := unguessed(spec.drafts([req], 4, {1: 10}))):
        position, token = spec.shadows[1]
        assert position == req.seq_len and token == req.output_ids[-1] + 1     # what followed in the prompt
        req.output_ids.append(token)                                           # decoding sampled it
        spec.compare([req])
        assert 1 not in spec.shadows and spec.paces[1].skip == 0
        rounds += 1
    assert 1 < rounds < 12 and spec.paces[1].rate >= Costs(4).worth(5) and found == {1: [req.output_ids[-1] + 1]}
    spec.shadows[1] = req.seq_len, 0
    assert spec.drafts([req], 4, {1: 10}) and 1 not in spec.shadows    # a verify step records it instead
    behind = Speculator(NgramConfig(4, 1, 1), rows=32, costs=Costs(4))        # behind drafts in flight: no shadow
    assert behind.drafts([req], 4, {1: 10}, {1: [3]}) == {} and not behind.shadows
    cold = Speculator(NgramConfig(4, 1, 1), rows=32, costs=Costs(4))
    assert cold.drafts([req], 4, {1: 10}) == {}
    position, token = cold.shadows[1]
    req.output_ids.append(token + 100)                                          # sampled otherwise
    cold.compare([req])
    assert cold.paces[1].rate < Pace().rate and cold.paces[1].skip == 0
    assert cold.drafts([req], 4, {1: 10}) == {} and 1 not in cold.shadows       # a token not seen before: no proposal
    cold.release(req)
    assert not cold.shadows and not cold.paces
