"""N-gram speculative decoding's configuration (vLLM's `speculative_config` for method "ngram") and its proposer:
prompt lookup, which guesses the next tokens by finding the sequence's last n tokens earlier in its prompt and
output and proposing what followed them there.

The proposer keeps, per sequence, the last position at which each n-gram (n in [min, max]) ended, and adds the
n-grams of each new token as it comes: a step costs a few dict operations whatever the prompt's length (a 16k-token
prompt is indexed once, as its first proposal is asked for)."""
from __future__ import annotations

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


@dataclass(slots=True)
class Lookup:
    """One sequence's n-gram index."""
    config: NgramConfig
    last: dict[tuple[int, ...], int] = field(default_factory=dict)    # n-gram -> the position it last ended at
    indexed: int = 0           # n-grams ending before this position are in `last`

    def propose(self, prompt: list[int], output: list[int], k: int, ahead: list[int] | None = None) -> list[int]:
        """k tokens that followed the longest earlier occurrence (the latest one) of the sequence's last n tokens (the
        sequence: prompt + output, read in place, then `ahead`: tokens assumed to come, not indexed), or none. An
        occurrence that runs into the sequence's end repeats what followed it with its period (LZ77's overlapping
        copy): [7, 7, 7] proposes [7] * k, where vLLM's lookup proposes the one 7 that followed."""
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

        low, high = self.config.low, self.config.high
        for end in range(self.indexed, settled - 1):    # all but the n-grams ending at the last token: the suffix
            for n in range(low, min(high, end + 1) + 1):
                self.last[span(end + 1 - n, end + 1)] = end
        self.indexed = max(self.indexed, settled - 1)
        if k <= 0:
            return []
        for n in range(min(high, size - 1), low - 1, -1):
            end = self.last.get(span(size - n, size))
            if end is not None:        # what followed; where that reaches the present, it repeats with its period
                out = list(span(end + 1, min(end + 1 + k, size)))
                period = size - end - 1
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []
