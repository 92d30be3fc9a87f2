"""EngineClient: what every front end talks to, whichever place the step loop runs in; and the one factory.

Two placements implement it: ThreadedEngine (serving/threaded.py: the step loop on a thread of this process) and
ProcessEngine (serving/process.py: the step loop in a child process, off this process's GIL). Both inherit
`generate` from here.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from engine.config import EngineConfig
from engine.core.output import Delta
from engine.core.sampling import SamplingParams
from engine.serving.metrics import Metrics
from engine.serving.supervisor import Health
from engine.tokenizer import Tokenizer

Push = Callable[[Delta], None]


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig            # with the model resolved
    metrics: Metrics                # current as of each final delta
    tokenizer: Tokenizer            # for front ends that template chats; the engine tokenizes prompts itself
    streams: dict[int, Push]        # open requests' push functions, by id
    health: Health                  # UP; RESTARTING (the engine process died, a new one is starting); FAILED
    why: str                        # what is wrong when it is not UP

    def submit(self, prompt: str | list[int], params: SamplingParams | None, push: Push,
               request_id: int | None = None) -> int:
        """Queue a request whose deltas `push` receives on a thread of the client's (it must not block); returns
        its id (`request_id`, when the caller numbers its requests itself). `prompt`: text (tokenized with the
        model's tokenizer, BOS as the model wants) or token ids; `params`: None for SamplingParams() (16 tokens at
        temperature 1.0). Raises ValueError naming the field on
        bad input, EngineUnavailable (a RuntimeError) when the engine is not up, Overloaded (a RuntimeError, with
        retry_after) when its queue cannot take the request now: all before any delta."""

    def abort(self, request_id: int) -> None:
        """Cancel a request: its final delta has finish_reason 'abort' and its KV is freed within one step."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop, waiting up to `timeout` seconds for it (and for the engine process, where there is
        one); requests still running end with an error delta."""

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """Stream deltas of one request (arguments as `submit`'s); each Delta carries the new `text` and `token_ids`,
        the last one `finished` and its `finish_reason`. Raises ValueError (naming the field) before the first
        delta on bad input. Closing the iterator early cancels the request."""
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request_id = self.submit(prompt, params, lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d))
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)
            self.streams.pop(request_id, None)


def make_client(config: EngineConfig) -> EngineClient:
    """A started engine for `config` (an EngineConfig: the model and every option, docs/options.md): the step loop
    in a child process when `config.engine_process` (the default), else on a thread of this process. The model is
    loaded before this returns; call `shutdown()` when done."""
    if config.engine_process:
        from engine.serving.process import ProcessEngine
        return ProcessEngine(config)
    from engine.serving.threaded import ThreadedEngine
    return ThreadedEngine(config)
