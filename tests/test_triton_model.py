"""The Triton model's threading, on the CPU and without tritonserver: a stand-in for pb_utils records which thread
built and which sent each response. With the engine in a child process (engine_process, config.pbtxt's default) and
on a thread, responses are built on the thread that receives the engine's deltas and sent on the responder thread; a
stream cancelled while responses wait to be sent gets nothing after its cancel error; a response that cannot be built
ends its request with an error, frees its KV, and the model serves on."""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from tests.helpers import random_ids, wait_until

MODEL_PY = Path(__file__).resolve().parent.parent / "model_repository/llm/1/model.py"


class TritonError:
    INTERNAL, INVALID_ARG, CANCELLED, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name, self.value = name, value

    def as_numpy(self) -> np.ndarray:
        return self.value


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.outputs = {t.name: t.value for t in output_tensors or []}
        self.error = error
        self.built_on = threading.current_thread().name


class Metric:
    def __init__(self, labels=None, buckets=None) -> None:
        self.value = 0.0

    def increment(self, v: float) -> None:
        self.value += v

    def set(self, v: float) -> None:
        self.value = v

    def observe(self, v: float) -> None:
        self.value = v


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.Metric = Metric


class Sender:
    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[tuple[InferenceResponse, int, str]] = []
        self.final = threading.Event()
        self.cancel_after = cancel_after

    def send(self, response: InferenceResponse, flags: int = 0) -> None:
        assert not self.final.is_set(), "a response after the final one"
        self.sent.append((response, flags, threading.current_thread().name))
        if flags:
            self.final.set()

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


class Request:
    def __init__(self, inputs: dict[str, np.ndarray], sender: Sender, parameters: str = "{}") -> None:
        self.inputs, self.sender, self._parameters = inputs, sender, parameters

    def get_response_sender(self) -> Sender:
        return self.sender

    def parameters(self) -> str:        # Triton hands them over as the JSON text of an object
        return self._parameters


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError, pb.Tensor, pb.InferenceResponse, pb.MetricFamily = TritonError, Tensor, InferenceResponse, \
        MetricFamily
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.TritonModelException = RuntimeError
    pb.Logger = types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None)
    pb.get_input_tensor_by_name = lambda req, name: Tensor(name, req.inputs[name]) if name in req.inputs else None
    pb.using_decoupled_model_transaction_policy = lambda cfg: cfg["model_transaction_policy"]["decoupled"]
    return pb


def start_model(monkeypatch, parameters: dict[str, str], model_dir: Path = MODEL_PY.parent.parent):
    """model.py loaded against the stand-in pb_utils and initialized with these config.pbtxt parameters, as the
    model in `model_dir` (whose 1/model.json, if any, it reads)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    spec = importlib.util.spec_from_file_location("pagoda_triton_model", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)         # its dataclasses look their module up
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = {"model_transaction_policy": {"decoupled": True},
              "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    model.initialize({"model_config": json.dumps(config), "model_name": "llm", "model_version": "1",
                      "model_repository": str(model_dir)})
    return module, model


@pytest.fixture(params=["process", "thread"])
def triton_model(request, tiny_dir, monkeypatch):
    module, model = start_model(monkeypatch, {"model": tiny_dir, "dtype": "float32", "num_threads": "1",
                                              "engine_process": str(request.param == "process")})
    yield module, model
    model.finalize()


def inputs(ids: list[int], max_tokens: int) -> dict[str, np.ndarray]:
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {"input_ids": np.array(ids, dtype=np.int32), "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_)}


def run(model, ids: list[int], max_tokens: int, cancel_after: int | None = None) -> Sender:
    sender = Sender(cancel_after)
    model.execute([Request(inputs(ids, max_tokens), sender)])
    assert sender.final.wait(60), "no final response"
    return sender


def idle(model) -> bool:
    """No request running or waiting and no KV block held, by the engine's gauges (the child's, mirrored)."""
    m = model.engine.metrics
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if m.value("pagoda_kv_blocks", state="used") == m.value("pagoda_batch_size") == 0 == \
                m.value("pagoda_queue_depth"):
            return True
        time.sleep(0.01)
    return False


def test_responses_are_built_where_deltas_arrive_and_sent_on_the_responder(triton_model, tiny_dir):
    _, model = triton_model
    ids = random_ids(20, seed=3)
    sender = run(model, ids, 6)
    assert all(r.error is None for r, _, _ in sender.sent)
    in_child = model.engine.config.engine_process
    assert {r.built_on for r, _, _ in sender.sent} == {"pagoda-engine-link" if in_child else "pagoda-engine"}
    assert {thread for _, _, thread in sender.sent} == {"pagoda-responder"}
    assert [flags for _, flags, _ in sender.sent] == [0] * (len(sender.sent) - 1) + [1]
    streamed = [int(i) for r, _, _ in sender.sent for i in r.outputs["output_ids"]]
    offline = LLM(model=tiny_dir, dtype="float32").generate([ids], SamplingParams(max_tokens=6, temperature=0,
                                                                                    ignore_eos=True))[0]
    assert streamed == offline.token_ids


def test_a_cancelled_stream_gets_nothing_after_its_cancel_error(triton_model):
    _, model = triton_model
    sender = run(model, random_ids(20, seed=4), 3000, cancel_after=2)
    last, flags, _ = sender.sent[-1]
    assert flags == 1 and last.error is not None and last.error.code == TritonError.CANCELLED
    assert all(r.error is None for r, _, _ in sender.sent[:-1])
    assert len(sender.sent) < 3000
    assert idle(model)


def test_a_response_that_cannot_be_built_fails_its_request_and_the_model_serves_on(triton_model, monkeypatch):
    module, model = triton_model
    real = module.triton_io.outputs
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*args)
    monkeypatch.setattr(module.triton_io, "outputs", flaky)
    sender = run(model, random_ids(20, seed=5), 50)
    last, flags, _ = sender.sent[-1]
    assert flags == 1 and last.error.code == TritonError.INTERNAL and "boom" in last.error.message
    assert len(sender.sent) == 3        # two tokens, then the error
    assert idle(model)
    again = run(model, random_ids(20, seed=6), 4)
    assert [r.error for r, _, _ in again.sent] == [None] * 4 and again.sent[-1][1] == 1


def test_while_the_engine_is_down_requests_are_unavailable_and_a_crash_loop_unloads(triton_model):
    """Restarting: a request is answered at once with UNAVAILABLE and the supervisor's reason. Down for good (a
    crash loop): the model asks Triton to unload it, so it reports not ready, as vllm_backend does."""
    from engine.serving.supervisor import Health
    module, model = triton_model
    unloaded: list[str] = []
    module.pb_utils.unload_model = unloaded.append
    engine = model.engine
    engine.health, engine.why = Health.RESTARTING, "engine: restarting after the engine process exited (code -9)"
    last, flags, _ = run(model, random_ids(10, seed=1), 4).sent[-1]
    assert flags == 1 and last.error.code == TritonError.UNAVAILABLE and "restarting" in last.error.message
    assert not unloaded
    engine.health = Health.FAILED
    wait_until(lambda: unloaded, "the model to ask for its unload")
    assert unloaded == ["llm"]
    engine.health, engine.why = Health.UP, ""
    assert run(model, random_ids(10, seed=1), 4).sent[-1][0].error is None


def test_finalize_stops_the_engine_without_asking_triton_to_unload(monkeypatch, tiny_dir):
    """The responder must not take finalize's shutdown for a crash loop: an unload asked for while Triton finalizes
    the model aborted tritonserver (a clean-clone CI run). A shut-down engine reads STOPPED."""
    from engine.serving.supervisor import Health
    module, model = start_model(monkeypatch, {"model": tiny_dir, "dtype": "float32", "num_threads": "1"})
    unloaded: list[str] = []
    module.pb_utils.unload_model = unloaded.append
    monkeypatch.setattr(module, "METRICS_SYNC_S", 0.0)          # the responder looks at the health every turn
    looks: list[Health] = []
    sync = model.mirror.sync
    model.mirror.sync = lambda: (sync(), looks.append(model.engine.health))
    shutdown = model.engine.shutdown

    def slow_shutdown() -> None:         # the responder turns at least twice before finalize queues its end
        shutdown()
        seen = len(looks)
        wait_until(lambda: len(looks) > seen + 1, "the responder to look at the shut-down engine")
    model.engine.shutdown = slow_shutdown
    model.finalize()
    assert looks[-1] is Health.STOPPED and not model.responder.is_alive()
    assert unloaded == []
