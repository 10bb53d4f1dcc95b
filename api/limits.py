"""Request body size limit (configuration), enforced while the body streams in."""

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, exempt_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Routes that stream their body and enforce a limit of their own (batch uploads).
        self.exempt_paths = exempt_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        message = f"request body is over {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(413, "body_too_large", message)(scope, receive, send)
            return
        received = 0

        # Chunked uploads carry no Content-Length: count bytes as they arrive. An HTTPException raised while
        # FastAPI reads the body reaches the error handlers as a 413.
        async def limited_receive() -> Message:
            nonlocal received
            message_in = await receive()
            if message_in["type"] == "http.request":
                received += len(message_in.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, message)
            return message_in

        await self.app(scope, limited_receive, send)
