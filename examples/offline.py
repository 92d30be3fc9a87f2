"""Offline generation with the LLM class, as vLLM's: greedy text, token ids, logprobs, and a prompt-cache hit.

    python examples/offline.py [--model DIR_OR_GGUF]
Without --model it uses the embedded default model (random weights, made and cached on first use).
"""
import argparse

from engine import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="a Hugging Face directory or a .gguf file")
args = parser.parse_args()

llm = LLM(model=args.model, dtype="float32")
params = SamplingParams(max_tokens=16, temperature=0, logprobs=2)
prompt = ("A prompt cache keeps the keys and values of the prompts it has seen, a block of 32 tokens at a time. "
          "A second request that starts with the same tokens adopts those blocks and computes only the rest, "
          "so its first token comes sooner, and its decode is as fast as the first request's. Now, a story:")

for attempt in ("cold", "hit"):
    out = llm.generate(prompt, params)[0]
    print(f"{attempt}: cached {out.cached_tokens}/{out.num_prompt_tokens} prompt tokens, "
          f"{len(out.token_ids)} new tokens, finish_reason={out.finish_reason}")
print("text:", repr(out.text))
print("first token's top logprobs:", {t: round(lp.logprob, 3) for t, lp in out.logprobs[0].items()})
