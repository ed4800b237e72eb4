"""What the dashboard's POST handlers share: the Origin check and a small form body."""

from __future__ import annotations

import hmac
from typing import Final
from urllib.parse import parse_qs

from starlette.requests import Request

_MAX_FORM_BYTES: Final = 64 * 1024


def same_origin(request: Request) -> bool:
    """The browser's Origin header names this dashboard (scheme, host and port)."""
    origin = request.headers.get("origin")
    if not origin:
        return False
    own = f"{request.url.scheme}://{request.url.netloc}"
    return hmac.compare_digest(origin.encode("utf-8", "replace"), own.encode())


async def read_form(request: Request) -> dict[str, str]:
    """A small urlencoded form body (no multipart, no files): each field's first value."""
    return {k: v[0] for k, v in (await read_fields(request)).items() if v}


async def read_fields(request: Request) -> dict[str, list[str]]:
    """A small urlencoded form body, every value of each field; {} when too large."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_FORM_BYTES:
            return {}
    return parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
