"""vLLM's bad_words: each word is tokenized as it stands and with a leading space (the spaced form only when it
starts with another token and has as many); a one-token word is never sampled, a longer one's last token is banned
wherever the output already ends with the rest of it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class BadWords:
    always: tuple[int, ...]           # one-token words: banned at every step
    sequences: list[list[int]]        # longer words' token sequences

    @classmethod
    def of(cls, words: list[str], encode: Callable[[str], list[int]]) -> BadWords:
        found: list[list[int]] = []
        for word in words:
            plain = encode(word.lstrip())
            found.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                found.append(spaced)
        return cls(tuple(s[0] for s in found if len(s) == 1), [s for s in found if len(s) > 1])

    def banned(self, output: list[int]) -> list[int]:
        """The last tokens of the longer words whose other tokens end `output` (the committed output)."""
        return [s[-1] for s in self.sequences if len(output) >= len(s) - 1 and output[len(output) - len(s) + 1:]
                == s[:-1]]
