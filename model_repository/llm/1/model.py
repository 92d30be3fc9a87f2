"""Decoupled Triton Python-backend model: streams tokens from Pagoda's asyncio engine."""
from __future__ import annotations

import asyncio
import json
import logging
import threading

import triton_python_backend_utils as pb_utils

from engine import triton_io
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.metrics import Mirror

INPUT_NAMES = [name for name, *_ in triton_io.INPUTS]
CANCEL_POLL_S = 0.05


class _TritonLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        (pb_utils.Logger.log_warn if record.levelno >= logging.WARNING else pb_utils.Logger.log_info)(
            self.format(record))


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
        log = logging.getLogger("pagoda")
        if not any(isinstance(h, _TritonLog) for h in log.handlers):
            log.addHandler(_TritonLog())
        log.setLevel(logging.INFO)
        self.engine = AsyncEngine(EngineConfig.from_sources(params))
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.mirror = Mirror(self.engine.engine.metrics, pb_utils.MetricFamily, kinds, labels)
        self.mirror.sync()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pagoda-triton", daemon=True)
        self.thread.start()
        self.metrics_task = asyncio.run_coroutine_threadsafe(self._sync_metrics(), self.loop)
        cfg = self.engine.engine.config
        log.info("pagoda: engine ready model=%s kv_storage=%s max_batch_size=%d lookahead=%s",
                 cfg.model, "paged" if cfg.paged else "dense", cfg.max_batch_size, cfg.use_lookahead)

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
        return None

    def finalize(self):
        log = logging.getLogger("pagoda")
        log.info("pagoda: finalize: stopping the engine")
        self.engine.shutdown()
        self.metrics_task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        log.info("pagoda: finalize: done")

    async def _sync_metrics(self):
        while True:
            self.mirror.sync()
            await asyncio.sleep(0.5)

    async def _serve(self, request):
        sender = request.get_response_sender()
        try:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            req = triton_io.parse(inputs)
            await self._stream(req, sender)
        except ValueError as e:
            self._fail(sender, triton_io.error_message(str(e)), pb_utils.TritonError.INVALID_ARG)
        except Exception as e:
            logging.getLogger("pagoda").exception("request failed")
            self._fail(sender, f"internal error: {e}", pb_utils.TritonError.INTERNAL)
        finally:
            self.mirror.sync()

    async def _stream(self, req: triton_io.TritonRequest, sender) -> None:
        deltas = self.engine.generate(req.prompt, req.params).__aiter__()
        text, ids = [], []
        try:
            while True:
                nxt = asyncio.ensure_future(deltas.__anext__())
                while not nxt.done():
                    await asyncio.wait({nxt}, timeout=CANCEL_POLL_S)
                    if not nxt.done() and sender.is_cancelled():
                        nxt.cancel()
                d = await nxt if not nxt.cancelled() else None
                if d is None or sender.is_cancelled():
                    self._fail(sender, "request cancelled", pb_utils.TritonError.CANCELLED)
                    return
                if d.finish_reason in ("error", "abort"):
                    self._fail(sender, d.error or "request aborted", pb_utils.TritonError.INTERNAL)
                    return
                if req.stream:
                    self._send(sender, req, d.text, d.token_ids, d)
                else:
                    text.append(d.text)
                    ids.extend(d.token_ids)
                    if d.finished:
                        prefix = req.prompt if req.prepend_input else ""
                        self._send(sender, req, prefix + "".join(text), ids, d)
                if d.finished:
                    return
        finally:
            await deltas.aclose()       # a request that did not finish is aborted and its KV freed

    def _send(self, sender, req, text, ids, d) -> None:
        arrays = triton_io.outputs(text, ids, req.extras, d.finish_reason, d.num_prompt_tokens,
                                   d.num_output_tokens, d.cached_tokens)
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if d.finished else 0)

    @staticmethod
    def _fail(sender, message: str, code) -> None:
        try:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:       # the client may be gone already
            logging.getLogger("pagoda").warning("could not send the error response: %s", message)
