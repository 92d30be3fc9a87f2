"""Decoupled Triton Python-backend model: streams tokens from Pagoda's engine.

The step loop runs in a child process (`engine_process`, on in config.pbtxt): every Python thread here shares one
GIL, and when the engine thread shared it too, each hand-off stalled the engine until this process's other thread
was scheduled (docs/serving-triton.md, "Why the step loop runs in a process", has the measurements).
A link thread (ProcessEngine's reader) turns each delta into a ready response and queues it; one responder thread
sends them and polls Triton for cancelled requests. `send` blocks on an IPC round trip to tritonserver with the GIL
released. With `engine_process` off, the engine thread builds the responses instead.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import triton_python_backend_utils as pb_utils

from engine.config import EngineConfig
from engine.core.admission import Overloaded
from engine.core.output import Delta
from engine.frontends import triton_io, vllm_args
from engine.serving.client import make_client
from engine.serving.metrics import Mirror
from engine.serving.supervisor import EngineUnavailable, Health

INPUT_NAMES = [name for name, *_ in triton_io.INPUTS]
CANCEL_POLL_S = 0.05
METRICS_SYNC_S = 0.5
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
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
    done: bool = False          # the engine is through with it (set on the engine thread)
    closed: bool = False        # its final response went out (set on the responder thread)
    parts: list[triton_io.Part] = field(default_factory=list)   # per sequence: finish reason, logprob sum; and,
                                                                # not streaming, everything so far

    def __post_init__(self) -> None:
        asked = self.req.params.logprobs is not None
        self.parts = [triton_io.Part(cumulative=0.0 if asked else None) for _ in range(self.req.params.n)]


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
        config = EngineConfig.from_sources(self._with_model_json(params, args))
        self.engine = make_client(config)
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.mirror = Mirror(self.engine.metrics, pb_utils.MetricFamily, kinds, labels)
        self.mirror.sync()
        self.model_name, self.unloading = args["model_name"], False
        self.claims = threading.Lock()
        self.outbox: queue.SimpleQueue[tuple[Stream, object, int] | None] = queue.SimpleQueue()
        self.active: set[Stream] = set()      # streams the responder polls for cancellation
        self.responder = threading.Thread(target=self._respond, name="pagoda-responder", daemon=True)
        self.responder.start()
        cfg = self.engine.config
        log.info("pagoda: engine ready model=%s kv_storage=%s max_batch_size=%d lookahead=%s",
                 cfg.model, "paged" if cfg.paged else "dense", cfg.max_batch_size, cfg.use_lookahead)

    @staticmethod
    def _with_model_json(params: dict[str, str], args) -> dict:
        """config.pbtxt's parameters, overridden by vllm_backend's model.json (vLLM engine arguments) beside this
        file when there is one; PAGODA_* overrides both (EngineConfig.from_sources)."""
        engine_args = vllm_args.read(Path(args["model_repository"]) / args["model_version"] / "model.json")
        if engine_args is None:
            return params
        values = vllm_args.engine_values(engine_args)
        overridden = sorted(k for k in values if k in params and str(params[k]) != str(values[k]))
        if overridden:
            log.info("pagoda: model.json overrides config.pbtxt's %s", ", ".join(overridden))
        return {**params, **values}

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
            stream = Stream(sender, triton_io.parse(inputs, request.parameters()))
            self.active.add(stream)
            stream.id = self.engine.submit(stream.req.prompt, stream.req.params,
                                           lambda d, s=stream: self._on_delta(s, d))
        except Overloaded as e:                 # UNAVAILABLE, which Triton clients and routers retry
            if self._claim(stream):
                self._fail(sender, f"{e} (retry after {e.retry_after} s)", pb_utils.TritonError.UNAVAILABLE)
        except EngineUnavailable as e:          # restarting after a crash, or down for good
            if self._claim(stream):
                self._fail(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
        except ValueError as e:
            if self._claim(stream):
                self._fail(sender, triton_io.error_message(str(e)), pb_utils.TritonError.INVALID_ARG)
        except Exception as e:
            log.exception("request failed")
            if self._claim(stream):
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
                self._send(*item)
            now = time.monotonic()
            if now - polled >= CANCEL_POLL_S:
                polled = now
                self._reap_cancelled()
            if now - synced >= METRICS_SYNC_S:
                synced = now
                self.mirror.sync()
                if self.engine.health is Health.FAILED and not self.unloading:
                    self._unload()

    def _on_delta(self, stream: Stream, d: Delta) -> None:
        """Where deltas arrive (the link thread, or the engine thread): queue the response a delta makes, if any."""
        if stream.done:
            return
        stream.id = d.request_id        # a first delta can beat submit() returning the id to _start
        final = d.finished or d.finish_reason in ("error", "abort")
        if final and not self._claim(stream):
            return                      # its submit failed meanwhile, and that error was its final response
        try:
            response = self._response(stream, d)
        except Exception as e:
            log.exception("could not build a response")
            self._cancel(stream)
            response, final = self._error(f"internal error: {e}", pb_utils.TritonError.INTERNAL), True
        if response is not None:
            self.outbox.put((stream, response, FINAL if final else 0))

    def _response(self, stream: Stream, d: Delta):
        """A streamed delta is one response, with every sequence's element (empty but for the delta's); not
        streaming, the deltas add up to one response at the end."""
        if d.finish_reason in ("error", "abort"):
            if not d.finished:          # n > 1: one sequence's error ends the request
                self._cancel(stream)
            return TritonPythonModel._error(d.error or "request aborted", pb_utils.TritonError.INTERNAL)
        part = stream.parts[d.index]
        part.finish_reason, part.cumulative = d.finish_reason, d.cumulative_logprob
        if d.decode_tok_s is not None:
            part.timing = (d.decode_tok_s, d.decode_cpu_ms)
        if stream.req.stream:
            parts = [triton_io.Part(finish_reason=p.finish_reason, cumulative=p.cumulative,
                                    logprobs=None if p.cumulative is None else [], timing=p.timing)
                     for p in stream.parts]
            # the other sequences' elements: nothing new, their finish reason, logprob sum and timing so far
            parts[d.index] = triton_io.Part(d.text, d.token_ids, d.finish_reason, d.logprobs, d.cumulative_logprob,
                                            part.timing)
        else:
            part.text += d.text
            part.ids.extend(d.token_ids)
            if d.logprobs is not None:
                part.logprobs = (part.logprobs or []) + d.logprobs
            if not d.finished:
                return None
            prefix = stream.req.prompt if stream.req.prepend_input else ""
            parts = [triton_io.Part(prefix + p.text, p.ids, p.finish_reason, p.logprobs, p.cumulative, p.timing)
                     for p in stream.parts]
        arrays = triton_io.outputs(parts, stream.req.extras, d.num_prompt_tokens, d.cached_tokens)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])

    def _send(self, stream: Stream, response, flags: int) -> None:
        if stream.closed:               # cancelled meanwhile: its error response was the final one
            return
        stream.closed = bool(flags)
        if flags:
            self.mirror.sync()          # first: a client that scrapes on a FINAL response sees its request counted
        try:
            stream.sender.send(response, flags=flags)
        except Exception:
            log.exception("could not send a response")
            stream.closed = True
            self._cancel(stream)

    def _reap_cancelled(self) -> None:
        for stream in list(self.active):
            if stream.id >= 0 and not stream.done and stream.sender.is_cancelled():
                self._cancel(stream)
                stream.closed = True
                self._fail(stream.sender, "request cancelled", pb_utils.TritonError.CANCELLED)

    def _unload(self) -> None:
        """The engine is down for good (a crash loop): have Triton unload the model, so it reports not ready and an
        orchestrator replaces the replica, as vllm_backend does with an unhealthy engine. Needs tritonserver's
        --model-control-mode=explicit (scripts/tritonserver.py passes it); otherwise requests stay UNAVAILABLE."""
        self.unloading = True
        log.error("pagoda: the engine is down for good; unloading the model: %s", self.engine.why)
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as e:
            log.error("pagoda: could not unload the model (%s); requests are refused UNAVAILABLE", e)

    def _cancel(self, stream: Stream) -> None:
        """End a stream the client left: the engine aborts it and frees its KV within one step."""
        self._forget(stream)
        self.engine.abort(stream.id)

    def _claim(self, stream: Stream | None) -> bool:
        """Mark a stream through with the engine; True for the one caller that does so first, whose FINAL response
        is the stream's only one (a submit that fails as the engine dies races the engine's own error delta)."""
        with self.claims:
            if stream is not None and stream.done:
                return False
            self._forget(stream)
        return True

    def _forget(self, stream: Stream | None) -> None:
        if stream is not None:
            stream.done = True
            self.active.discard(stream)

    @staticmethod
    def _error(message: str, code):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    @staticmethod
    def _fail(sender, message: str, code) -> None:
        try:
            sender.send(TritonPythonModel._error(message, code), flags=FINAL)
        except Exception:       # the client may be gone already
            log.warning("could not send the error response: %s", message)
