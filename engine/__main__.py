"""CLI: python -m engine make-model | generate | serve."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from engine.config import EngineConfig


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=None, help="Hugging Face Qwen2 directory (default: the embedded small model)")
    p.add_argument("--runner", default=d.runner, choices=["torch", "mlx"])
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--kv-storage", default=d.kv_storage, choices=["auto", "paged", "dense"])
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument("--prompt-cache", type=_bool, default=d.prompt_cache)
    p.add_argument("--lookahead", type=_bool, default=d.lookahead)
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--num-threads", type=int, default=d.num_threads)
    p.add_argument("--attention", default=d.attention, choices=["auto", "triton", "reference", "cpu"])
    p.add_argument("--contiguous-blocks", type=_bool, default=d.contiguous_blocks)
    p.add_argument("--compile", type=_bool, default=d.compile, help="torch.compile the paged decode step")
    p.add_argument("--engine-process", type=_bool, default=d.engine_process,
                   help="serve: the step loop in a child process, off the server's GIL (false: a thread)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, runner=args.runner, device=args.device, dtype=args.dtype,
                        max_batch_size=args.max_batch_size, kv_storage=args.kv_storage, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, prompt_cache=args.prompt_cache, lookahead=args.lookahead,
                        prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                        num_threads=args.num_threads, attention=args.attention,
                        contiguous_blocks=args.contiguous_blocks, compile=args.compile,
                        engine_process=args.engine_process)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write a seeded random Qwen2 checkpoint in Hugging Face layout")
    mk.add_argument("--preset", required=True, choices=["tiny", "tiny-odd", "small", "qwen2.5-0.5b"])
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    gen = sub.add_parser("generate", help="stream a completion for one prompt")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--repeat", type=int, default=1, help="run the prompt N times (the repeats hit the prompt cache)")
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* (env PAGODA_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    srv.add_argument("--max-body-bytes", type=int, default=int(os.environ.get("PAGODA_MAX_BODY_BYTES", 8 << 20)),
                     help="refuse larger request bodies with 413 (env PAGODA_MAX_BODY_BYTES; default 8 MiB)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.cmd == "make-model":
        from engine.models.presets import make_model
        print(make_model(args.preset, args.out, args.seed))
        return 0
    if args.cmd == "serve":
        return serve(args)
    return generate(args)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.engine_process import EngineProcess
    from engine.server.app import create_app
    from engine.server.body_limit import BodyLimit
    config = engine_config(args)
    engine = (EngineProcess if config.engine_process else AsyncEngine)(config)
    name = args.served_model_name or os.path.basename(os.path.normpath(engine.config.model))
    app = BodyLimit(create_app(engine, name, args.api_key), args.max_body_bytes)
    logging.getLogger("pagoda").info("serving %s on http://%s:%d", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5)       # then open streams are cut and their requests aborted
    finally:
        engine.shutdown()
    return 0


def generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    try:
        engine = Engine(engine_config(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) \
            if args.chat else args.prompt
        for run in range(args.repeat):
            req = engine.add(engine.make_request(prompt, params))
            start, first, last, final = time.monotonic(), 0.0, 0.0, None
            while final is None:
                for d in engine.step():
                    now = time.monotonic()
                    if d.token_ids:
                        first, last = first or now, now
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                    if d.finished:
                        final = d
            n = len(req.output_ids)
            rate = (n - 1) / (last - first) if n > 1 and last > first else 0.0
            print(f"\n[run {run + 1}] ttft={1000 * (first - start):.1f}ms decode={rate:.1f}tok/s "
                  f"tokens={n} cached={final.cached_tokens}/{final.num_prompt_tokens} "
                  f"finish={final.finish_reason}", file=sys.stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
