"""Penalties and logit bias on the device, as vLLM defines them: presence and frequency penalties over the output's
token counts, the repetition penalty over every token of the prompt and the output (a positive logit is divided
by it, a negative one multiplied). Each sequence's output counts live in a row of one [slots, vocab] table and
grow by each decode step's input token, which is the previous step's output still on the device, so lookahead
keeps overlapping. A speculative verify row also counts the drafts before it, for its own sampling only; the
drafts a step accepted join the table with the sequence's next row."""
from __future__ import annotations

import torch

from engine.runners.base import Row
from engine.runners.torch.host import upload


class Penalties:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.slots: dict[int, int] = {}                   # sequence -> row of the tables
        self.free: list[int] = []
        self.counts = torch.zeros((0, vocab), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab), dtype=torch.bool, device=device)

    def count(self, rows: list[Row], ids: torch.Tensor, last: list[int]) -> None:
        """Before a step runs: each penalized decode row's input token joins its sequence's counts."""
        picked = [i for i, r in enumerate(rows) if r.fed_output and r.params is not None and r.params.penalized]
        if picked:
            slots = self._slots([rows[i] for i in picked])
            self.counts.index_put_((slots, ids[[last[i] for i in picked]]),
                                   torch.ones(len(picked), dtype=torch.int32, device=self.device), accumulate=True)
        late = [(r, t) for r in rows if r.counted and r.params is not None and r.params.penalized for t in r.counted]
        if late:                    # accepted drafts: output that was never a fed row's input
            self.counts.index_put_((self._slots([r for r, _ in late]), upload([t for _, t in late], self.device)),
                                   torch.ones(len(late), dtype=torch.int32, device=self.device), accumulate=True)

    def apply(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """Bias, then penalize, the logits [B, V] of the rows that sample, in place."""
        for i, r in enumerate(rows):
            if r.params is not None and r.params.logit_bias:
                ids, bias = zip(*r.params.logit_bias.items())
                logits[i, upload(ids, self.device)] += upload(bias, self.device, logits.dtype)
        picked = [i for i, r in enumerate(rows) if r.params is not None and r.params.penalized]
        if not picked:
            return
        slots = self._slots([rows[i] for i in picked])
        counts, x = self.counts[slots].to(logits.dtype), logits[picked]
        drafted = [(q, t) for q, i in enumerate(picked) for t in rows[i].drafts]
        if drafted:                 # a verify row: the drafts before it, as if they had come one at a time
            q, t = zip(*drafted)
            counts.index_put_((upload(q, self.device), upload(t, self.device)),
                              torch.ones(len(q), dtype=counts.dtype, device=self.device), accumulate=True)
        seen = counts > 0
        column = [[rows[i].params.repetition_penalty, rows[i].params.frequency_penalty,
                   rows[i].params.presence_penalty] for i in picked]
        rep, freq, pres = upload(column, self.device, logits.dtype).T[:, :, None]
        x = torch.where(seen | self.in_prompt[slots], torch.where(x > 0, x / rep, x * rep), x)
        logits[picked] = x - freq * counts - pres * seen.to(logits.dtype)

    def release(self, seq: int) -> None:
        slot = self.slots.pop(seq, None)
        if slot is not None:
            self.free.append(slot)

    def _slots(self, rows: list[Row]) -> torch.Tensor:
        return upload([self._slot(r) for r in rows], self.device)

    def _slot(self, row: Row) -> int:
        slot = self.slots.get(row.seq)
        if slot is None:
            if not self.free:
                have = self.counts.shape[0]
                grow = max(4, have)
                self.counts = torch.cat([self.counts, self.counts.new_zeros((grow, self.vocab))])
                self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros((grow, self.vocab))])
                self.free = list(range(have + grow - 1, have - 1, -1))
            slot = self.slots[row.seq] = self.free.pop()
            self.counts[slot] = 0
            self.in_prompt[slot] = False
            if row.prompt:
                self.in_prompt[slot, torch.tensor(row.prompt, dtype=torch.long, device=self.device)] = True
        return slot
