"""N-gram speculative decoding's configuration (vLLM's `speculative_config` for method "ngram") and its proposer:
prompt lookup, which guesses the next tokens by finding the sequence's last n tokens earlier in its prompt and
output and proposing what followed them there.

The proposer keeps, per sequence, the last position at which each n-gram (n in [min, max]) ended, and adds the
n-grams of each new token as it comes: a step costs a few dict operations whatever the prompt's length (a 16k-token
prompt is indexed once, as its first proposal is asked for).

Given the vocabulary's indentation tokens (`Blanks`), it also finds a suffix whose indentation differs from the
prompt's (code re-indented as it is rewritten: a method lifted out of its class), and indents what it proposes
from the prompt by as many columns as the output's lines have moved."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.core.structured import json_object

KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(slots=True, frozen=True)
class NgramConfig:
    k: int                     # num_speculative_tokens: draft tokens a step verifies at most
    low: int = 5               # prompt_lookup_min / _max: the n-gram lengths matched (vLLM's defaults, 5 and 5)
    high: int = 5

    @staticmethod
    def parse(value: Any, field_name: str = "speculative_config") -> NgramConfig | None:
        """From vLLM's object (or its JSON text); None or {} is off. ValueError names the key and the reason."""
        if value in (None, "", {}):
            return None
        value = json_object(value, field_name)
        for key in value:
            if key not in KEYS:
                raise ValueError(f"{field_name}.{key}: not supported (known: {', '.join(KEYS)})")
        if value.get("method") != "ngram":
            raise ValueError(f"{field_name}.method: only \"ngram\" is supported, got {value.get('method')!r}")
        for key in KEYS[1:]:
            v = value.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{field_name}.{key}: expected an integer >= 1, got {v!r}")
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError(f"{field_name}.num_speculative_tokens: needed for method ngram")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        if low > high:
            raise ValueError(f"{field_name}.prompt_lookup_min: {low} is above prompt_lookup_max {high}")
        return NgramConfig(k, low, high)


@dataclass(slots=True, frozen=True)
class Blanks:
    """The vocabulary's tokens of spaces and tabs alone: a match takes any of them for any other. One that follows a
    line's end (a token of `breaks`) is a line's indentation."""
    widths: dict[int, int]      # token -> its columns where it is spaces alone, else 0 (a tab)
    spaces: dict[int, int]      # columns -> the token of that many spaces
    breaks: frozenset[int]      # the tokens whose text ends a line

    @staticmethod
    def of(texts: Mapping[int, str], breaks: frozenset[int] = frozenset()) -> Blanks:
        """From the tokens' texts and the line ends (Tokenizer.layout)."""
        widths = {t: 0 if "\t" in text else len(text) for t, text in texts.items()}
        return Blanks(widths, {w: t for t, w in widths.items() if w}, breaks)

    def reach(self, gram: tuple[int, ...]) -> int:
        """The shortest n whose last n tokens of `gram` hold a blank (past its length where none does)."""
        if self.widths.keys().isdisjoint(gram):
            return len(gram) + 1
        return len(gram) - max(i for i, t in enumerate(gram) if t in self.widths)

    def loose(self, gram: tuple[int, ...]) -> tuple[int, ...]:
        """The n-gram with each blank as -1 (no token's id)."""
        return tuple(-1 if t in self.widths else t for t in gram)

    def shifted(self, token: int, shift: int) -> int | None:
        """The token of spaces `shift` columns wider (narrower) than `token`, where both are spaces alone; None
        where that is no columns (a line moved to the margin)."""
        width = self.widths.get(token, 0)
        if not width or not shift:
            return token
        return None if width + shift == 0 else self.spaces.get(width + shift, token)


NO_BLANKS = Blanks({}, {}, frozenset())     # exact matching alone, as vLLM's lookup


@dataclass(slots=True)
class Lookup:
    """One sequence's n-gram index."""
    config: NgramConfig
    blanks: Blanks = NO_BLANKS
    last: dict[tuple[int, ...], int] = field(default_factory=dict)    # n-gram -> the position it last ended at
    before: dict[tuple[int, ...], int] = field(default_factory=dict)  # the position it ended at before that
    loose: dict[tuple[int, ...], int] = field(default_factory=dict)   # the same for n-grams with a blank, as -1
    indexed: int = 0           # n-grams ending before this position are in `last` and `loose`
    shift: int = 0             # columns the output's lines are indented past the prompt's (the latest match that
    #                            lined up a line's indentation in the prompt with one in the output)

    def propose(self, prompt: list[int], output: list[int], k: int, ahead: list[int] | None = None) -> list[int]:
        """k tokens that followed the longest earlier occurrence (the latest one) of the sequence's last n tokens (the
        sequence: prompt + output, read in place, then `ahead`: tokens assumed to come, not indexed), or none. An
        occurrence that runs into the sequence's end repeats what followed it with its period (LZ77's overlapping
        copy): [7, 7, 7] proposes [7] * k, where vLLM's lookup proposes the one 7 that followed. With blanks, an
        n-gram may also match with its blanks taken loosely, as long as one that matches exactly, but after it; and
        the indentation of lines read from the prompt is moved by `shift` (a line moved to the margin loses it, so
        the proposal may be shorter than k). Where an exact n-gram occurred before its latest occurrence too, the
        proposal stops where what followed the two parts: the token there is a guess between them, and a wrong
        draft costs its row and every row after it."""
        settled = len(prompt) + len(output)
        if ahead:
            output = output + ahead
        size = len(prompt) + len(output)

        def span(lo: int, hi: int) -> tuple[int, ...]:
            if hi <= len(prompt):
                return tuple(prompt[lo:hi])
            if lo >= len(prompt):
                return tuple(output[lo - len(prompt):hi - len(prompt)])
            return tuple(prompt[lo:]) + tuple(output[:hi - len(prompt)])

        low, high, blanks = self.config.low, self.config.high, self.blanks
        for end in range(self.indexed, settled - 1):    # all but the n-grams ending at the last token: the suffix
            top = min(high, end + 1)
            gram = span(end + 1 - top, end + 1)
            reach = blanks.reach(gram)
            for n in range(low, top + 1):
                key = gram[top - n:]
                if (seen := self.last.get(key)) is not None:
                    self.before[key] = seen
                self.last[key] = end
                if n >= reach:
                    self.loose[blanks.loose(key)] = end
        self.indexed = max(self.indexed, settled - 1)
        if k <= 0:
            return []
        top = min(high, size - 1)
        suffix = span(size - top, size) if top >= low else ()
        reach = blanks.reach(suffix)
        for n in range(top, low - 1, -1):
            gram = suffix[top - n:]
            end = self.last.get(gram)
            prior = self.before.get(gram) if end is not None else None
            if n >= reach:
                if end is None:
                    end = self.loose.get(blanks.loose(gram))
                if end is not None:
                    self._align(span(end + 1 - n, end + 1), gram, len(prompt) - (end + 1 - n))
            if end is not None:        # what followed; where that reaches the present, it repeats with its period
                out = list(span(end + 1, min(end + 1 + k, size)))
                period = size - end - 1
                while len(out) < k:
                    out.append(out[len(out) - period])
                if prior is not None:        # as far as what followed the occurrence before agrees
                    seen = span(prior + 1, prior + 1 + min(k, period))
                    out = out[:next((i for i, (a, b) in enumerate(zip(seen, out)) if a != b), k)]
                return self._indent(out, end + 1, period, prompt) if self.shift else out
        return []

    def _indent(self, out: list[int], start: int, period: int, prompt: list[int]) -> list[int]:
        """`out` (read from `start` on, with its period) with the indentation of the prompt's lines moved."""
        moved = []
        for i, t in enumerate(out):
            at = start + i % period
            if 0 < at < len(prompt) and prompt[at - 1] in self.blanks.breaks:
                t = self.blanks.shifted(t, self.shift)
            if t is not None:
                moved.append(t)
        return moved

    def _align(self, source: tuple[int, ...], gram: tuple[int, ...], in_prompt: int) -> None:
        """Learn how far the output's indentation has moved from the prompt's: the last pair of a line's indentation
        (spaces after a line's end) a match lines up (`in_prompt`: how many of the source's tokens are the
        prompt's; a line's end is a token a loose match takes as it is)."""
        widths, breaks = self.blanks.widths, self.blanks.breaks
        for i in range(1, min(in_prompt, len(gram))):
            a, b = source[i], gram[i]
            if source[i - 1] in breaks and widths.get(a) and widths.get(b):
                self.shift = widths[b] - widths[a]
