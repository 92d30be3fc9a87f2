"""Streaming from the engine in your own asyncio program: what the servers do inside.

    python examples/streaming.py [--model DIR_OR_GGUF]
`make_client` runs the step loop in a child process (engine_process=true, the default); `generate` yields a Delta
per step with the new text and token ids; leaving the loop early cancels the request.
"""
import argparse
import asyncio

from engine import EngineConfig, SamplingParams
from engine.serving.client import make_client


async def main(model: str | None) -> None:
    engine = make_client(EngineConfig(model=model, dtype="float32"))
    try:
        params = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
        tokens = 0
        async for delta in engine.generate("Once upon a time", params):
            print(delta.text, end="", flush=True)
            tokens += len(delta.token_ids)
            if delta.finished:
                print(f"\n[{tokens} tokens, finish_reason={delta.finish_reason}]")
    finally:
        engine.shutdown()


parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="a Hugging Face directory or a .gguf file")
asyncio.run(main(parser.parse_args().model))
