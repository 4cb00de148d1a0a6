"""The gate in front of the app: the API key (401) and the request body's size (413).

``Gate`` is ASGI middleware, so a refused request never reaches a route. ``read_json`` is the
routes' side of the size limit: it reads a body that arrives in chunks (the gate counts them)
and decodes it, a 413 past the limit and a 400 for a body that is not JSON.
"""

import hmac
import json

from fastapi import FastAPI, Request

from .protocol import APIError, error_body
from .responses import send_json


class BodyTooLarge(Exception):
    """Raised from the gate's receive, inside the route's read, when the bytes pass the limit."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self.limit = limit


class Gate:
    """ASGI middleware in front of the app: the API key (401) and the body size limit (413).
    A body over the limit is refused from its Content-Length before it is read, or, when it
    comes in chunks without one, as soon as the bytes read pass the limit."""

    def __init__(self, app: FastAPI, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.limit = app, api_key, max_request_bytes
        self.state = app.state  # so that callers reach app.state through the gate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            # compare_digest: the time taken does not tell how much of the key matched
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await send_json(send, 401, error_body(
                    401, "missing or wrong API key: send the header 'Authorization: Bearer "
                         "<key>' with the key given to --api-key"))
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await send_json(send, 413, too_large(int(length), self.limit))
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        return await self.app(scope, counted_receive, send)


def too_large(size: int | None, limit: int) -> dict:
    """The 413 body; size is None when the body came without a Content-Length."""
    what = f"{size} bytes" if size is not None else "more bytes"
    return error_body(413, f"the request body of {what} is over the limit of {limit} bytes "
                           "(--max-request-bytes)")


async def read_json(request: Request):
    """The request's body, decoded: an APIError(413) past the limit, (400) if not JSON."""
    try:
        body = await request.body()
    except BodyTooLarge as err:
        raise APIError(413, too_large(None, err.limit)["error"]["message"]) from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:
        # ValueError: JSONDecodeError, UnicodeDecodeError, and an integer of more digits than
        # Python converts (4300); RecursionError: arrays or objects nested thousands deep.
        raise APIError(400, f"the request body is not valid JSON: {err}"[:300]) from None
