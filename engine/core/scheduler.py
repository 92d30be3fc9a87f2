"""Admission, continuous batching, chunked prefill and recompute preemption."""
from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.core.request import Request, Status
from engine.kv.base import KVStorage


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVStorage) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        """Queue a request; admission (core/admission.py) has already bounded the queue."""
        self.waiting.append(req)

    def admit(self) -> tuple[list[Request], list[Request]]:
        """Move waiting requests into the batch while KV allows; returns (admitted, never-fitting)."""
        admitted, too_big = [], []
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) + req.width > self.config.max_batch_size:
                break
            if not self.kv.fits(req):
                too_big.append(self.waiting.popleft())
                continue
            if not self.kv.admit(req):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted, too_big

    def prefill_plan(self) -> list[tuple[Request, int]]:
        """(request, tokens) chunks for this tick, at most `prefill_chunk` tokens in all."""
        plan, budget = [], self.config.prefill_chunk
        for req in self.running:
            if budget and req.prefilling and not req.cancelled:
                n = min(req.prefill_target - req.num_computed, budget)
                plan.append((req, n))
                budget -= n
        return plan

    def join(self, req: Request) -> None:
        """A forked sequence joins the batch (its first sequence was admitted with room for it)."""
        req.status = Status.RUNNING
        self.running.append(req)

    def decoding(self) -> list[Request]:
        return [r for r in self.running if not r.prefilling]

    def preempt(self) -> Request:
        """Send the youngest running request back to the head of the queue; its KV is recomputed later."""
        req = self.running.pop()
        self.kv.release(req)
        req.num_computed = req.num_allocated = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        return req

    def remove(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.kv.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
