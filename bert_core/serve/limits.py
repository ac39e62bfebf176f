"""The limits `bert serve` puts in front of its app (KServe's V2 routes and MLflow's scoring
app): an ASGI middleware. Errors come in the shape of the route's protocol.

- A body over `max_body_bytes` -> 413, whether the request declares it (Content-Length: refused
  before a byte of it is read) or streams it (chunked: counted as it arrives, refused at the
  first byte over). The body is read here, into memory, before the app sees it (as MLflow's app
  would read it, `await request.body()`), so a request holds at most `max_body_bytes`.
- More than `max_concurrency` requests to the model (/invocations, V2 infer, V1 predict) in
  flight (read, queued or computing) -> 503 with `Retry-After`, answered before the body is
  read: a flood is turned away at the cost of parsing its headers, and memory stays under
  `max_concurrency` x `max_body_bytes`. /ping, /health, /version and V2's health and metadata
  routes are never refused, so a health check answers under any load.
- A body not received within `body_timeout` seconds -> 408 (a slow client holding a slot).
- Request headers not complete within `header_timeout` seconds: the connection is closed
  (`with_header_timeout`, on uvicorn's HTTP protocol: a connection that never finishes its
  headers never reaches the app, so no middleware can time it out; uvicorn has no header timeout
  of its own, only the keep-alive one between requests). Such a connection holds no model slot
  meanwhile, but it counts against uvicorn's `--max-connections`, which refuses /ping too.

Why not uvicorn's `limit_concurrency` (uvicorn/protocols/http/h11_impl.py): it counts open
connections as well as requests, so 32 idle keep-alive clients fill it; its 503 is plain text
without `Retry-After`; and it refuses /ping too. `bert serve` still sets it, higher
(`--max-connections`), as the backstop against connection floods.

Why not Starlette's `RequestBodyLimitMiddleware` (starlette/middleware/body_limit.py, FastAPI's
`max_body_size`, which MLflow's app leaves unset: unlimited): its 413 is plain text, not MLflow's
JSON, and it counts bytes while the app reads them rather than before a slot is taken.

Errors are JSON in MLflow's shape, `{"error_code": ..., "message": ...}`. A 413 or 503 is sent
without `Connection: close`: uvicorn then reads and drops the rest of the body and keeps the
connection (h11_impl's `handle_events` skips body data once the response is done), whereas
closing with unread data in the socket makes the kernel send a reset, which can destroy the
response before the client reads it.
"""

from __future__ import annotations

import asyncio
import json


def limited(path: str) -> bool:
    """A request that reaches the model: MLflow's /invocations, V2's /v2/models/NAME/infer,
    KServe's V1 /v1/models/NAME:predict."""
    return path == "/invocations" or path.endswith("/infer") or path.endswith(":predict")


class _TooLarge(Exception):
    pass


class Limits:
    """ASGI middleware around `app`; see the module doc."""

    def __init__(
        self,
        app,
        max_body_bytes: int,
        max_concurrency: int,
        body_timeout: float = 30.0,
        retry_after: int = 1,
    ):
        self.app, self.max_body_bytes, self.max_concurrency = app, max_body_bytes, max_concurrency
        self.body_timeout, self.retry_after = body_timeout, retry_after
        self.in_flight = 0  # requests to the model (`limited`) admitted and not yet answered

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: the app's own startup and shutdown
            await self.app(scope, receive, send)
            return
        # KServe's routes answer errors in its shape, MLflow's in MLflow's (`refuse`)
        v2 = scope["path"].startswith(("/v1/", "/v2/"))
        declared = content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self.too_large(send, v2, declared)
            return
        to_model = limited(scope["path"])
        if to_model and self.in_flight >= self.max_concurrency:
            message = (
                f"the server is at its limit of {self.max_concurrency} requests in flight "
                f"(--max-concurrency); retry in {self.retry_after} s"
            )
            retry = [(b"retry-after", str(self.retry_after).encode())]
            await refuse(send, 503, "TEMPORARILY_UNAVAILABLE", message, retry, v2)
            return
        self.in_flight += to_model
        try:
            try:
                body = await asyncio.wait_for(self.read_body(receive), self.body_timeout)
            except _TooLarge:
                await self.too_large(send, v2)
                return
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                message = f"the request body did not arrive within {self.body_timeout:g} s"
                close = [(b"connection", b"close")]
                await refuse(send, 408, "BAD_REQUEST", message, close, v2)
                return
            if body is not None:  # None: the client went away
                await self.app(scope, replay(body, receive), send)
        finally:
            self.in_flight -= to_model

    async def read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def too_large(self, send, v2: bool, declared: int | None = None) -> None:
        size = "" if declared is None else f"{declared:,} bytes, "
        message = (
            f"the request body is {size}more than the server's limit of "
            f"{self.max_body_bytes:,} bytes (--max-body-bytes)"
        )
        await refuse(send, 413, "REQUEST_LIMIT_EXCEEDED", message, (), v2)


def with_header_timeout(protocol: type, seconds: float) -> type:
    """uvicorn's HTTP `protocol` class (h11's or httptools', the same attributes) closing a
    connection whose request headers are not complete `seconds` after it opened or after the
    first bytes of its next request: what nginx's `client_header_timeout` does to a slowloris."""

    class HeaderTimeout(protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._between_requests():
                self._disarm()
            elif self._header_timer is None:  # the next request's first bytes
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeout


def content_length(scope) -> int | None:
    """The declared body length (h11 has refused malformed values with a 400 already)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None


def replay(body: bytes, receive):
    """A `receive` that hands the app the body read already, then the client's own events."""
    sent = False

    async def receive_again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


async def refuse(send, status: int, code: str, message: str, headers=(), v2=False) -> None:
    """An error answer: MLflow's body (`error_code`, `message`), or for KServe's routes
    (`v2`) the Open Inference Protocol's (`error`)."""
    error = {"error": message} if v2 else {"error_code": code, "message": message}
    body = json.dumps(error).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + list(headers)})
    await send({"type": "http.response.body", "body": body, "more_body": False})
