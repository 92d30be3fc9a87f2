"""Stream a completion from the Triton model over gRPC with tritonclient, the tensors vllm_backend takes.

    make serve                                  # in another terminal: tritonserver on model_repository/
    python examples/triton_grpc_stream.py [--url localhost:8001] [--prompt "..."]
"""
import argparse
import json
import queue

import numpy as np
import tritonclient.grpc as grpcclient

parser = argparse.ArgumentParser()
parser.add_argument("--url", default="localhost:8001")
parser.add_argument("--prompt", default="The capital of France is")
args = parser.parse_args()


def tensor(name: str, value, dtype: str) -> grpcclient.InferInput:
    array = np.array([value], dtype=object if dtype == "BYTES" else bool)
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


inputs = [tensor("text_input", args.prompt.encode(), "BYTES"),
          tensor("stream", True, "BOOL"),
          tensor("sampling_parameters", json.dumps({"max_tokens": 16, "temperature": 0}).encode(), "BYTES"),
          tensor("return_finish_reason", True, "BOOL"),
          tensor("return_cached_tokens", True, "BOOL")]

responses: queue.Queue = queue.Queue()
client = grpcclient.InferenceServerClient(args.url)
client.start_stream(callback=lambda result, error: responses.put((result, error)))
client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
finish_reason, cached = None, None
while True:
    result, error = responses.get(timeout=60)
    if error is not None:
        raise SystemExit(f"error: {error}")
    response = result.get_response()
    if response.outputs:
        print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
        if result.as_numpy("finish_reason")[0] != b"None":      # vllm_backend's str(None) until the end
            finish_reason = result.as_numpy("finish_reason")[0].decode()
            cached = int(result.as_numpy("cached_tokens")[0])
    if response.parameters["triton_final_response"].bool_param:
        break
client.stop_stream(cancel_requests=True)     # the final response is in: close without waiting on the server
print(f"\n[finish_reason={finish_reason}, cached_tokens={cached}]")
