"""Decoupled Triton Python-backend model: streams tokens from Pagoda's engine thread.

The engine thread hands each delta to a queue; one responder thread turns deltas into responses and polls
Triton for cancelled requests. No per-token asyncio hop: the responder holds the GIL as briefly as it can,
since every moment it holds it the engine thread waits.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from engine import triton_io
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.metrics import Mirror
from engine.request import Delta

INPUT_NAMES = [name for name, *_ in triton_io.INPUTS]
CANCEL_POLL_S = 0.05
METRICS_SYNC_S = 0.5
log = logging.getLogger("pagoda")


class _TritonLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        (pb_utils.Logger.log_warn if record.levelno >= logging.WARNING else pb_utils.Logger.log_info)(
            self.format(record))


@dataclass(slots=True, eq=False)
class Stream:
    sender: object
    req: triton_io.TritonRequest
    id: int = -1
    done: bool = False
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        inputs, outputs = triton_io.config_io()
        have = config.as_dict()
        have_in = {i["name"] for i in have.get("input", [])}
        have_out = {o["name"] for o in have.get("output", [])}
        for i in inputs:
            if i["name"] not in have_in:
                config.add_input(i)
        for o in outputs:
            if o["name"] not in have_out:
                config.add_output(o)
        config.set_max_batch_size(0)
        config.set_model_transaction_policy({"decoupled": True})
        return config

    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("llm: the model must be decoupled (model_transaction_policy)")
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        if not any(isinstance(h, _TritonLog) for h in log.handlers):
            log.addHandler(_TritonLog())
        log.setLevel(logging.INFO)
        self.engine = AsyncEngine(EngineConfig.from_sources(params))
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.mirror = Mirror(self.engine.engine.metrics, pb_utils.MetricFamily, kinds, labels)
        self.mirror.sync()
        self.outbox: queue.SimpleQueue[tuple[Stream, Delta] | None] = queue.SimpleQueue()
        self.active: set[Stream] = set()      # streams the responder polls for cancellation
        self.responder = threading.Thread(target=self._respond, name="pagoda-responder", daemon=True)
        self.responder.start()
        cfg = self.engine.engine.config
        log.info("pagoda: engine ready model=%s kv_storage=%s max_batch_size=%d lookahead=%s",
                 cfg.model, "paged" if cfg.paged else "dense", cfg.max_batch_size, cfg.use_lookahead)

    def execute(self, requests):
        for request in requests:
            self._start(request)
        return None

    def _start(self, request) -> None:
        sender = request.get_response_sender()
        stream = None
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            stream = Stream(sender, triton_io.parse(inputs))
            self.active.add(stream)
            stream.id = self.engine.submit(stream.req.prompt, stream.req.params,
                                           lambda d, s=stream: self.outbox.put((s, d)))
        except ValueError as e:
            self._forget(stream)
            self._fail(sender, triton_io.error_message(str(e)), pb_utils.TritonError.INVALID_ARG)
        except Exception as e:
            self._forget(stream)
            log.exception("request failed")
            self._fail(sender, f"internal error: {e}", pb_utils.TritonError.INTERNAL)

    def finalize(self):
        log.info("pagoda: finalize: stopping the engine")
        self.engine.shutdown()
        self.outbox.put(None)
        self.responder.join(timeout=5)
        log.info("pagoda: finalize: done")

    def _respond(self) -> None:
        polled = synced = time.monotonic()
        while True:
            try:
                item = self.outbox.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._on_delta(*item)
            now = time.monotonic()
            if now - polled >= CANCEL_POLL_S:
                polled = now
                self._reap_cancelled()
            if now - synced >= METRICS_SYNC_S:
                synced = now
                self.mirror.sync()

    def _on_delta(self, stream: Stream, d: Delta) -> None:
        if stream.done:
            return
        stream.id = d.request_id        # a first delta can beat submit() returning the id to _start
        try:
            if d.finished:
                self._forget(stream)
                self.mirror.sync()
            if d.finish_reason in ("error", "abort"):
                self._fail(stream.sender, d.error or "request aborted", pb_utils.TritonError.INTERNAL)
            elif stream.req.stream:
                self._send(stream, d.text, d.token_ids, d)
            else:
                stream.text.append(d.text)
                stream.ids.extend(d.token_ids)
                if d.finished:
                    prefix = stream.req.prompt if stream.req.prepend_input else ""
                    self._send(stream, prefix + "".join(stream.text), stream.ids, d)
        except Exception:
            log.exception("could not send a response")
            self._cancel(stream)

    def _reap_cancelled(self) -> None:
        for stream in list(self.active):
            if stream.id >= 0 and not stream.done and stream.sender.is_cancelled():
                self._cancel(stream)
                self._fail(stream.sender, "request cancelled", pb_utils.TritonError.CANCELLED)

    def _cancel(self, stream: Stream) -> None:
        """End a stream the client left: the engine aborts it and frees its KV within one step."""
        self._forget(stream)
        self.engine.abort(stream.id)

    def _forget(self, stream: Stream | None) -> None:
        if stream is not None:
            stream.done = True
            self.active.discard(stream)

    @staticmethod
    def _send(stream: Stream, text: str, ids: list[int], d: Delta) -> None:
        arrays = triton_io.outputs(text, ids, stream.req.extras, d.finish_reason, d.num_prompt_tokens,
                                   d.num_output_tokens, d.cached_tokens)
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
        stream.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if d.finished else 0)

    @staticmethod
    def _fail(sender, message: str, code) -> None:
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:       # the client may be gone already
            log.warning("could not send the error response: %s", message)
