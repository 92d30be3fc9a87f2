"""llama.cpp's side of bench-peers, run by the llama-cpp-python environment's own interpreter (perf/llama_peer.py
builds it): loads one GGUF and answers JSON lines on stdin, one run each, so both engines stay loaded and their
runs alternate. Standalone on purpose: that environment has llama_cpp and nothing of this project.

    {"prompt": [ids], "tokens": N}  ->  {"ttft": seconds, "times": [arrival of each token, seconds], "ids": [tokens]}
"""
import json
import sys
import time

from llama_cpp import Llama


def run(llm: Llama, prompt: list[int], tokens: int) -> dict:
    start = time.perf_counter()
    times, ids = [], []
    # greedy (temp 0), every other sampler off; generate() never stops on EOS itself, so EOS is ignored
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        ids.append(int(token))
        if len(times) == tokens:
            break
    return {"ttft": times[0] - start, "times": [t - start for t in times], "ids": ids}


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(run(llm, ask["prompt"], ask["tokens"])), flush=True)


if __name__ == "__main__":
    main()
