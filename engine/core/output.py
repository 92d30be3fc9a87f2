"""Output processing: a sampled token becomes text, a finish reason, and the Delta streamed to the client."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request
from engine.runners.base import TokenLogprobs
from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class Logprob:
    """vLLM's shape: one token's logprob, its rank among all tokens (1 = the most likely), its text."""
    logprob: float
    rank: int
    decoded_token: str


PositionLogprobs = dict[int, Logprob]          # token id -> Logprob: the sampled token, then the top ones


@dataclass(slots=True)
class Delta:
    """What one sequence of a request gained since its last delta. A sequence's last delta has its finish_reason;
    the request's last delta (its last sequence's) has `finished` set too. n = 1: one sequence, index 0."""
    request_id: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None      # stop | length | abort | error: this sequence ended
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None     # one per token in token_ids, when asked for
    cumulative_logprob: float | None = None            # over all tokens so far, when logprobs were asked for
    index: int = 0                                     # the sequence (parallel sampling, n > 1)
    prompt_logprobs: list[PositionLogprobs | None] | None = None    # on the request's first delta, when asked
    # the engine's timing of this sequence's decode (Request.decode_timing), on its last delta
    decode_tok_s: float | None = None
    decode_cpu_ms: float | None = None

    def __reduce__(self):
        # Pickled per token across the process boundary: positional fields, not a slot-state dict.
        return Delta, (self.request_id, self.token_ids, self.text, self.finished, self.finish_reason, self.error,
                       self.num_prompt_tokens, self.num_output_tokens, self.cached_tokens, self.logprobs,
                       self.cumulative_logprob, self.index, self.prompt_logprobs, self.decode_tok_s,
                       self.decode_cpu_ms)


class Output:
    """Detokenizes, applies stop tokens, stop strings and length limits, and cuts deltas. Text that could still
    become a stop string is held back until it cannot."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int, tokenizer: Tokenizer) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def append(self, req: Request, token: int, lp: TokenLogprobs | None = None) -> str | None:
        """Add a sampled token (and its logprobs, when the request asked) to the request; returns its finish
        reason, or None while it goes on."""
        req.output_ids.append(token)
        if lp is not None:
            self._add_logprobs(req, token, lp)
        p, n = req.params, len(req.output_ids)
        if req.grammar is not None and not req.grammar.accept(token):
            req.error = f"structured output: token {token} does not continue the grammar"
            return "error"
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        delta = req.detok.add(token)
        req.text += delta
        if p.stop and delta and n >= p.min_tokens and self._cut_at_stop(req, len(delta)):
            return "stop"
        if req.grammar is not None and req.grammar.done:        # complete, its stop token taken (ignore_eos too)
            req.text += req.detok.flush()
            return "stop"
        if n >= p.max_tokens or req.seq_len >= self.max_model_len:
            req.text += req.detok.flush()
            return "length"
        return None

    def delta(self, req: Request, final: bool = False) -> Delta:
        """The tokens and text not yet streamed; marks them streamed."""
        end = len(req.text)
        if not final and req.params.stop:
            end = max(req.sent_text, end - max(len(s) for s in req.params.stop) + 1)
        done = final and all(s.finished for s in req.group or ())
        delta = Delta(req.group_id, req.output_ids[req.sent_ids:], req.text[req.sent_text:end], done,
                      req.finish_reason, req.error, len(req.prompt_ids), len(req.output_ids), max(req.num_cached, 0),
                      index=req.index)
        if req.logprobs is not None:
            delta.logprobs, delta.cumulative_logprob = req.logprobs[req.sent_ids:], req.cumulative_logprob
        if req.prompt_logprobs is not None and req.sent_ids == 0:
            delta.prompt_logprobs = req.prompt_logprobs
        if final and (timing := req.decode_timing()):
            delta.decode_tok_s, delta.decode_cpu_ms = timing
        req.sent_ids, req.sent_text = len(req.output_ids), end
        return delta

    def _add_logprobs(self, req: Request, token: int, lp: TokenLogprobs) -> None:
        if req.logprobs is None:
            req.logprobs = []
        req.logprobs.append(self._position(token, lp))
        req.cumulative_logprob += lp.logprob

    def add_prompt_logprobs(self, req: Request, start: int, found: list[TokenLogprobs]) -> None:
        """A prefill chunk's prompt logprobs: position start + i predicted prompt token start + i + 1 (a chunk run
        again after a preemption adds only what is missing)."""
        for i, lp in enumerate(found):
            target = start + i + 1
            if target == len(req.prompt_logprobs):
                req.prompt_logprobs.append(self._position(req.prompt_ids[target], lp))

    def _position(self, token: int, lp: TokenLogprobs) -> PositionLogprobs:
        text = self.tokenizer.token_text
        position = {token: Logprob(lp.logprob, lp.rank, text(token))}       # vLLM's order: this token, then the top
        for rank, (t, v) in enumerate(lp.top, start=1):
            position.setdefault(t, Logprob(v, rank, text(t)))
        return position

    @staticmethod
    def _cut_at_stop(req: Request, added: int) -> bool:
        """Whether the text now holds a stop string (searched only where the new text could complete one); the
        text is cut before it."""
        window = max(len(s) for s in req.params.stop) + added
        tail_start = max(0, len(req.text) - window)
        hits = [(i, len(s)) for s in req.params.stop if (i := req.text.find(s, tail_start)) >= 0]
        if not hits:
            return False
        at, length = min(hits)
        req.text = req.text[:at + length] if req.params.include_stop_str_in_output else req.text[:at]
        return True
