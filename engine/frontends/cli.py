"""CLI: python -m engine make-model | generate | serve. Engine and server flags derive from engine/config.py."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from engine.config import EngineConfig, ServeConfig, add_flags, from_flags
from engine.models.presets import PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write a seeded random checkpoint of a preset in Hugging Face layout")
    mk.add_argument("--preset", required=True, choices=sorted(PRESETS))
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    gen = sub.add_parser("generate", help="stream a completion for one prompt")
    add_flags(gen, EngineConfig, skip=("seed",))        # --seed is the request's here (PAGODA_SEED: the model's)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", dest="request_seed", type=int, default=None, help="seed of this request's sampler")
    gen.add_argument("--repeat", type=int, default=1, help="run the prompt N times (the repeats hit the prompt cache)")
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_flags(srv, EngineConfig)
    add_flags(srv, ServeConfig)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.cmd == "make-model":
        from engine.models.presets import make_model
        print(make_model(args.preset, args.out, args.seed))
        return 0
    try:
        config = from_flags(EngineConfig, args)
        if args.cmd == "serve":
            return serve(config, from_flags(ServeConfig, args))
        return generate(config, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def serve(config: EngineConfig, options: ServeConfig) -> int:
    import uvicorn

    from engine.frontends.openai.app import create_app
    from engine.frontends.openai.body_limit import BodyLimit
    from engine.serving.client import make_client
    engine = make_client(config)
    name = engine.config.model_name
    try:
        app = BodyLimit(create_app(engine, name, options.api_key, options.tool_call_parser,
                                   options.enable_auto_tool_choice, options.reasoning_parser), options.max_body_bytes)
        logging.getLogger("pagoda").info("serving %s on http://%s:%d", name, options.host, options.port)
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=5)       # then open streams are cut and their requests aborted
    finally:
        engine.shutdown()
    return 0


def generate(config: EngineConfig, args: argparse.Namespace) -> int:
    from engine.core.engine import Engine
    from engine.core.output import Delta
    from engine.core.sampling import SamplingParams
    arrivals: list[tuple[float, Delta]] = []
    engine = Engine(config, on_delta=lambda d: arrivals.append((time.monotonic(), d)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed)
    chat = args.chat and engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt = engine.tokenizer.encode(chat) if chat else args.prompt
    for run in range(args.repeat):
        req = engine.add(engine.make_request(prompt, params))
        start, first, last, final = time.monotonic(), 0.0, 0.0, None
        while final is None:
            engine.step()
            for now, d in arrivals:
                if d.token_ids:
                    first, last = first or now, now
                sys.stdout.write(d.text)
                sys.stdout.flush()
                final = d if d.finished else final
            arrivals.clear()
        n = len(req.output_ids)
        rate = (n - 1) / (last - first) if n > 1 and last > first else 0.0
        print(f"\n[run {run + 1}] ttft={1000 * (first - start):.1f}ms decode={rate:.1f}tok/s "
              f"tokens={n} cached={final.cached_tokens}/{final.num_prompt_tokens} "
              f"finish={final.finish_reason}", file=sys.stderr)
    return 0
