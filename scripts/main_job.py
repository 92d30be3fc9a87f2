"""The main job (`make run`): tritonserver on the embedded default model, one prompt streamed cold, then again
as a prompt-cache hit, with TTFT, decode tok/s and cached tokens for each; the server is stopped at the end."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.stream import stream_grpc            # noqa: E402
from scripts.tritonserver import launch          # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    args = ap.parse_args()
    prompt = (ROOT / "engine/models/corpus.txt").read_text(encoding="utf-8")[:args.prompt_chars]
    log = Path(tempfile.mkdtemp(prefix="pagoda-triton-")) / "tritonserver.log"
    started = time.monotonic()
    server = launch({}, log)
    print(f"tritonserver ready in {time.monotonic() - started:.1f}s (grpc {server.grpc_url}, log {log})")
    try:
        params = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        for label in ("miss", "hit"):
            r = stream_grpc(server.grpc_url, "llm", prompt, params)
            if r.error:
                print(f"{label}: error: {r.error}", file=sys.stderr)
                return 1
            print(f"{label:4}  ttft={r.ttft * 1000:7.1f}ms  decode={r.decode_rate:7.1f} tok/s  "
                  f"tokens={len(r.ids)}  cached={r.cached_tokens}/{r.num_input_tokens}  finish={r.finish_reason}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
