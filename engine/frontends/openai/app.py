"""The OpenAI-compatible app: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health, /metrics.
A client that disconnects mid-stream closes the engine stream, which aborts the request and frees its KV."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.admission import Overloaded
from engine.core.output import Delta
from engine.frontends.openai.logprobs import Shaper, prompt
from engine.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest, usage
from engine.frontends.openai.tool_parsers import PARSERS, guess
from engine.frontends.openai.tools import Differ, Reader, ToolChoice, call_id, message
from engine.serving.client import EngineClient
from engine.serving.supervisor import EngineUnavailable, Health


class Choices:
    """Per choice (one per sequence, by index): the echoed prompt before its first text, its logprobs' shaper."""

    def __init__(self, chat: bool, top: int | None, echoed: str) -> None:
        self.chat, self.top, self.echoed = chat, top, echoed
        self.shapers: dict[int, Shaper] = {}

    def text(self, index: int, text: str) -> str:
        first = index not in self.shapers
        self.shapers.setdefault(index, Shaper(self.chat, self.top, len(self.echoed)))
        return self.echoed + text if first else text

    def logprobs(self, index: int, positions, tokens: list[int]):
        return self.shapers[index](positions, tokens)


def completion_tokens(deltas: list[Delta]) -> int:
    """All sequences' output tokens: each sequence's last delta counts its whole output."""
    return sum({d.index: d.num_output_tokens for d in deltas}.values())


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """An error as OpenAI and vLLM shape it; `code` is the HTTP status."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# what /render echoes as the request's sampling_params
SAMPLING_ECHO = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "ignore_eos"}


def create_app(engine: EngineClient, model_name: str, api_key: str | None = None, tool_parser: str | None = None,
               auto_tools: bool = False, reasoning_parser: str | None = None) -> FastAPI:
    """`tool_parser` (hermes | llama3_json | mistral | auto: the chat template's) reads tool calls; `auto_tools`
    lets tool_choice "auto" (vLLM's --enable-auto-tool-choice); `reasoning_parser` (qwen3 | deepseek_r1)."""
    app = FastAPI(title="Pagoda")
    default_max = 16
    if tool_parser == "auto":
        tool_parser = guess(engine.tokenizer.chat_template)
        if tool_parser is None:
            raise ValueError("tool_call_parser: auto cannot tell the format from this model's chat template; name "
                             f"one of {', '.join(PARSERS)}")
    if tool_parser is not None and tool_parser not in PARSERS:
        raise ValueError(f"tool_call_parser: one of {', '.join(PARSERS)} or auto, got {tool_parser!r}")

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/") and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "missing or wrong API key", "authorization", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error(400, f"body: not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})", "body")
        field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return error(400, f"{field}: {first['msg']}", field)

    @app.get("/health")
    async def health():
        """200 while the engine serves; 503 while it restarts after a crash, or is down for good (a crash loop, or
        shut down): a readiness probe takes the replica out of rotation, a liveness probe on a FAILED one replaces
        it."""
        if engine.health is Health.UP:
            return {"status": "ok"}
        return JSONResponse({"status": engine.health.value, "error": engine.why}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "pagoda"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await serve(body, body.prompt, "text_completion", chat=False)

    def templated(body: ChatCompletionRequest) -> tuple[list[int] | None, JSONResponse | None]:
        """The chat's tokens, by the checkpoint's template (which writes any BOS itself: none added, as vLLM's
        add_special_tokens=False for chat) with the request's tools and chat_template_kwargs; else the 400."""
        try:
            text = engine.tokenizer.apply_chat_template([m.template() for m in body.messages], tools=body.tools,
                                                        **(body.chat_template_kwargs or {}))
            return engine.tokenizer.encode(text), None
        except (ValueError, TypeError) as e:
            message = str(e) if str(e).startswith("messages") else f"messages: {e}"
            return None, error(400, message, "messages")

    def reader(body: ChatCompletionRequest) -> Reader:
        """How the output reads back: tool calls by the request's tool_choice, reasoning apart (ValueError: 400)."""
        choice = ToolChoice.of(body.tools, body.tool_choice, body.parallel_tool_calls, tool_parser, auto_tools)
        if choice is not None and choice.mode in ("required", "named") and body.structure() is not None:
            raise ValueError("tool_choice: give tools or a structured output (response_format, structured_outputs), "
                             "not both")
        thinking = (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        return Reader(choice, tool_parser, reasoning_parser, thinking)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        try:
            read = reader(body)
        except ValueError as e:
            return error(400, str(e), str(e).split(":", 1)[0])
        prompt, refused = templated(body)
        if refused:
            return refused
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await serve(body, prompt, "chat.completion", chat=True, read=read)

    # vLLM's render endpoints: a request's prompt as token ids, nothing generated. Cache-aware routers (the vLLM
    # project's router for kv_aware) ask for them to match a request against the blocks replicas report.
    @app.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest):
        return render(body, body.prompt, "cmpl", many=True)

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest):
        prompt, refused = templated(body)
        return refused or render(body, prompt, "chatcmpl", many=False)

    def render(body, prompt, prefix: str, many: bool):
        if body.model != model_name:
            return error(404, f"model: {body.model!r} is not served here (serving {model_name!r})", "model",
                         "not_found_error")
        ids = engine.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        if body.truncate_prompt_tokens is not None:
            ids = ids[-body.truncate_prompt_tokens:]            # as generation truncates: the last k tokens
        out = {"request_id": f"{prefix}-{uuid.uuid4().hex[:24]}", "model": model_name, "token_ids": ids,
               "sampling_params": body.model_dump(include=SAMPLING_ECHO, exclude_none=True),
               "stream": body.stream, "stream_options": body.stream_options and body.stream_options.model_dump(),
               "token_offsets": None}
        return [out] if many else out

    async def serve(body, prompt, kind: str, chat: bool, read: Reader | None = None):
        if body.model != model_name:
            return error(400, f"model: {body.model!r} is not served here (serving {model_name!r})", "model")
        try:
            params = body.sampling(default_max)
            if read is not None and read.choice is not None:
                held = read.choice.structure(tool_parser)
                if held is not None and params.structured_outputs is None:     # auto beside response_format: text
                    params.structured_outputs = held
                if read.choice.mode == "auto":         # the parsers read the tags special tokens spell
                    params.skip_special_tokens = False
            stream = engine.generate(prompt, params)
            first = await anext(stream)        # validation errors surface here, before any byte is sent
        except EngineUnavailable as e:
            return error(503, str(e), kind="service_unavailable")
        except Overloaded as e:                # before any byte: a router or client retries it elsewhere or later
            return error(429, str(e), kind="overloaded", headers={"Retry-After": str(e.retry_after)})
        except ValueError as e:
            message = str(e)
            return error(400, message, message.split(":", 1)[0])
        echoed = ""
        if not chat and body.echo:             # completions: the prompt's text leads each choice's text
            echoed = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
        choices = Choices(chat, params.logprobs, echoed)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return StreamingResponse(sse(rid, kind, body, first, stream, chat, choices, read),
                                     media_type="text/event-stream")
        out, failure = await whole(rid, kind, first, stream, chat, choices, read)
        return error(500, failure, kind="server_error") if failure else JSONResponse(out)

    async def whole(rid: str, kind: str, first: Delta, stream: AsyncIterator[Delta], chat: bool,
                    choices: Choices, read: Reader | None) -> tuple[dict, str | None]:
        deltas = [first]
        while not deltas[-1].finished:
            deltas.append(await anext(stream))
        failed = next((d for d in deltas if d.finish_reason == "error"), None)
        by_index: dict[int, list[Delta]] = {}
        for d in deltas:
            by_index.setdefault(d.index, []).append(d)
        out = []
        for index, seq in sorted(by_index.items()):
            text = choices.text(index, "".join(d.text for d in seq))
            ids = [t for d in seq for t in d.token_ids]
            positions = [p for d in seq for p in d.logprobs or ()]
            choice = {"index": index, "finish_reason": seq[-1].finish_reason, "token_ids": ids,
                      "logprobs": choices.logprobs(index, positions, ids)}
            if chat and read is not None and read.active:
                view = read.view(text, final=True)
                choice["message"] = message(view, [call_id(tool_parser) for _ in view.calls])
                choice["finish_reason"] = read.finish(view, choice["finish_reason"])
            else:
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            if not chat and first.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt(first.prompt_logprobs)
            out.append(choice)
        last = deltas[-1]
        result = {"id": rid, "object": kind, "created": int(time.time()), "model": model_name, "choices": out,
                  "usage": usage(last.num_prompt_tokens, completion_tokens(deltas), last.cached_tokens)}
        if chat and first.prompt_logprobs is not None:
            result["prompt_logprobs"] = prompt(first.prompt_logprobs)
        return result, (failed.error or "request failed") if failed else None

    async def sse(rid: str, kind: str, body, first: Delta, stream: AsyncIterator[Delta], chat: bool,
                  choices: Choices, read: Reader | None):
        obj = "chat.completion.chunk" if chat else kind
        d, seen = first, {}
        shaped = chat and read is not None and read.active
        texts: dict[int, str] = {}
        differs: dict[int, Differ] = {}
        try:
            while True:
                if d.finish_reason == "error":       # then [DONE], as vLLM ends a stream after an error
                    yield f"data: {json.dumps(error_body(500, d.error or 'request failed', kind='server_error'))}\n\n"
                    break
                seen[d.index] = d.num_output_tokens
                text = choices.text(d.index, d.text)
                part = {"index": d.index, "finish_reason": d.finish_reason, "token_ids": d.token_ids,
                        "logprobs": choices.logprobs(d.index, d.logprobs, d.token_ids)}
                if shaped:
                    texts[d.index] = texts.get(d.index, "") + text
                    view = read.view(texts[d.index], final=d.finished)
                    part["delta"] = differs.setdefault(d.index, Differ(tool_parser)).delta(view)
                    part["finish_reason"] = read.finish(view, d.finish_reason)
                else:
                    part.update({"delta": {"content": text}} if chat else {"text": text})
                chunk = {"id": rid, "object": obj, "model": model_name, "choices": [part]}
                if d.prompt_logprobs is not None:          # the first chunk, as vLLM sends them
                    (chunk if chat else part)["prompt_logprobs"] = prompt(d.prompt_logprobs)
                yield f"data: {json.dumps(chunk)}\n\n"
                if d.finished:
                    break
                d = await anext(stream)
            if body.include_usage and d.finish_reason != "error":
                chunk = {"id": rid, "object": obj, "model": model_name, "choices": [],
                         "usage": usage(d.num_prompt_tokens, sum(seen.values()), d.cached_tokens)}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()          # a disconnect lands here: the request is aborted, its blocks freed

    return app
