"""Intake: a prompt and its SamplingParams become a Request, or a ValueError naming the field. Tokenizes, checks
the prompt against the context and the vocabulary, asks the runner what it cannot honour, makes the sequences of a
parallel-sampling request (n > 1) and their grammar matchers and bad-word tables. Runs on the caller's thread."""
from __future__ import annotations

import itertools
from dataclasses import replace

from engine.config import EngineConfig
from engine.core.bad_words import BadWords
from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.kv.base import KVStorage
from engine.runners.base import ModelRunner
from engine.tokenizer import Tokenizer


class Intake:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer, kv: KVStorage,
                 max_model_len: int) -> None:
        self.config, self.runner, self.tokenizer, self.kv = config, runner, tokenizer, kv
        self.max_model_len = max_model_len
        self.ids = itertools.count()
        self.fork_ids = itertools.count(-1, -1)      # parallel sampling's extra sequences: never a client's id
        self.grammars = None

    def make(self, prompt: str | list[int], params: SamplingParams | None = None,
             request_id: int | None = None) -> Request:
        params = params or SamplingParams()
        ids, field = self._tokens(prompt, params)
        self.runner.check(params)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.config.max_logprobs:
                raise ValueError(f"{name}: {asked} exceeds max_logprobs ({self.config.max_logprobs})")
        vocab = self.runner.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            for t in getattr(params, name) or ():
                if t >= vocab:
                    raise ValueError(f"{name}: token id {t} is outside the vocabulary [0, {vocab})")
        if params.n > self.config.max_batch_size:
            raise ValueError(f"n: {params.n} sequences exceed max_batch_size ({self.config.max_batch_size})")
        req = Request(next(self.ids) if request_id is None else request_id, ids, params)
        if params.n > 1:
            req.group = [req]
            for i in range(1, params.n):          # as vLLM: each sequence n=1, a seeded one seed + its index
                seed = None if params.seed is None else params.seed + i
                req.group.append(Request(next(self.fork_ids), ids, replace(params, n=1, seed=seed), index=i,
                                         group=req.group))
            req.params = replace(params, n=1)
            req.forks = req.group[1:]
        if not self.kv.fits(req):
            raise ValueError(f"{field}: {len(ids)} tokens need more KV blocks than the pool holds")
        compiled = params.structured_outputs and self._grammars().compile(params.structured_outputs)
        bad = BadWords.of(params.bad_words, self.tokenizer.encode) if params.bad_words else None
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]               # the first prompt token has nothing before it
        for seq in req.group or [req]:
            seq.detok = self.tokenizer.detokenizer(params.skip_special_tokens)
            seq.grammar = compiled and self.grammars.matcher(compiled)
            seq.bad_words = bad
        return req

    def _tokens(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], str]:
        """The prompt's token ids (truncated as asked) and the name its errors use."""
        if isinstance(prompt, str):
            ids, field = self.tokenizer.encode_prompt(prompt), "prompt"
        else:
            ids, field = list(prompt), "input_ids"
            vocab = self.runner.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"input_ids: token id {t!r} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError(f"{field}: must not be empty")
        if params.truncate_prompt_tokens is not None:          # as vLLM: the prompt's last k tokens
            keep = params.truncate_prompt_tokens if params.truncate_prompt_tokens > 0 else self.max_model_len - 1
            ids = ids[-keep:]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{field}: {len(ids)} tokens leave no room in the model's context of "
                             f"{self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.max_model_len}")
        return ids, field

    def _grammars(self):
        """xgrammar over this checkpoint's vocabulary, made at the first structured-output request."""
        if self.grammars is None:
            from engine.grammar import Grammars
            self.grammars = Grammars(self.tokenizer, self.runner.vocab_size,
                                     self.tokenizer.stop_ids(self.runner.eos_token_ids))
        return self.grammars
