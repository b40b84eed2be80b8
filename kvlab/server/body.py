"""Request bodies: read within a size limit, parsed as strict JSON within a nesting limit.

Every way a body can be bad becomes an `APIError` in OpenAI's shape, never a 500:

    over --max-body-bytes                        413 request_too_large   (before it is all read)
    not all there within --body-timeout          408 request_timeout     (and the connection closes)
    not JSON, not UTF-8, NaN / Infinity literals 400 invalid_json
    nested deeper than MAX_JSON_DEPTH            400 invalid_json        (100,000 levels: no RecursionError)
    a string with a lone surrogate ("\\ud800")    400 invalid_unicode     (it could not be tokenized)
    not an object                                400 invalid_json

`read_body` runs on the event loop; `parse_json` is CPU work and runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json

from kvlab.server.protocol import APIError

MAX_JSON_DEPTH = 64  # OpenAI bodies nest a few levels (messages → content parts → text)


async def read_body(request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, at most `limit` bytes, all arrived within `timeout_s` (None: no limit).

    A body that is late gets 408 with `Connection: close`: the rest of it, if it ever comes, is not
    read, and the connection is not reused."""
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s ({size:,} bytes came)",
                       code="request_timeout", headers={"Connection": "close"}) from None  # fmt: skip
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, checked for depth and Unicode."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object")
    _check_tree(body)
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(body: dict) -> None:
    """Walk the parsed body once: depth, and strings (keys too) that are valid Unicode."""
    stack = [(body, 1, None)]  # value, depth, the top-level field it is under (the error's param)
    while stack:
        value, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field or key)
                stack.append((item, depth + 1, field or key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, field) for item in value)
        elif isinstance(value, str):
            _check_text(value, field)


def _check_text(text: str, field: str | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"{field!r:.40}" if field is not None else "the body"  # repr: the field may be the bad string
        param = field if field is not None and field is not text else None
        raise APIError(400, f"{where} holds invalid Unicode ({e.reason}: {text[e.start:e.end]!r} at character "
                            f"{e.start}); send UTF-8 text", param=param, code="invalid_unicode") from None  # fmt: skip


def _invalid(message: str) -> APIError:
    return APIError(400, message, code="invalid_json")
