"""ASGI middleware: refuse request bodies over a byte limit with a 413 JSON error, before the app reads them."""
from __future__ import annotations

import json


class BodyLimit:
    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                return await self._refuse(send, length.decode(errors="replace"))
            return await self.app(scope, receive, send)
        chunks, size = [], 0            # chunked upload: read it here, up to the limit, then replay it
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send, f"more than {size}")
            if not message.get("more_body"):
                break
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            out, body = body, b""
            return {"type": "http.request", "body": out, "more_body": False}
        await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        payload = json.dumps({"error": {"message": f"body: {size} bytes exceed the limit of {self.limit}",
                                        "type": "invalid_request_error", "param": "body"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
