"""Local-server hygiene, checked before any route runs: who may name this server, send to it, read from it.

Any web page the user visits can send requests to a server on loopback, and DNS rebinding (a name
of the page's own that later resolves to 127.0.0.1) lets it read the replies as well. Three rules,
as llama.cpp's and Jupyter's servers have them, keep web pages out:

- **Host.** The `Host` header must be an IP address, `localhost`, the name the server is bound to,
  or one of `--allowed-hosts` (`*`: anything). A rebinding page's requests carry its own domain
  name there and are refused (400, `invalid_host`). Names cannot be checked against what they
  resolve to, so a server reached by a name needs that name in `--allowed-hosts`.
- **Origin and CORS.** Browsers send `Origin` on cross-site requests. Without `--allowed-origins`
  no CORS header is ever sent and a request carrying an `Origin` is refused (403,
  `origin_not_allowed`); with it, those origins (or `*`) get CORS headers and preflight answers.
  The server's own origin is not cross-site: its page at `/` (web.py) sends `Origin` with every
  POST, and it passes when it equals the request's scheme and Host, a Host named as above.
- **Content type.** A page may POST `text/plain`, a form or multipart data without a preflight
  ("simple" requests), never `application/json`: POST bodies must be `application/json`, UTF-8
  (415, `unsupported_media_type`).

Refusals have OpenAI's error shape. The middleware is plain ASGI, so streaming is untouched.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass

PREFLIGHT_MAX_AGE_S = 600
ALLOWED_METHODS = "GET, POST, OPTIONS"


@dataclass(frozen=True)
class GuardConfig:
    bound_host: str = "127.0.0.1"  # the address the server listens on (a name given to --host is allowed too)
    allowed_hosts: tuple[str, ...] = ()  # more Host names; "*" allows any
    allowed_origins: tuple[str, ...] = ()  # origins that may call from a browser (CORS); "*" allows any
    cors_headers: tuple[str, ...] = ("authorization", "content-type")  # request headers a preflight may allow

    def host_allowed(self, host_header: str | None) -> bool:
        if host_header is None or "*" in self.allowed_hosts:
            return True  # HTTP/1.0 clients send none; browsers always do
        return self._names_this_server(host_header)

    def same_origin(self, origin: str, scheme: str, host_header: str | None) -> bool:
        """The request comes from a page of this server's own origin (scheme and Host), by a name it
        was given. Not by `*` alone: a rebinding page's origin is its own name, which `*` lets in."""
        if host_header is None or origin.rstrip("/").lower() != f"{scheme}://{host_header.strip()}".lower():
            return False
        return self._names_this_server(host_header)

    def _names_this_server(self, host_header: str) -> bool:
        """An IP address, localhost, the bound name or one of allowed_hosts (`*` aside)."""
        name = _hostname(host_header)
        if name is None:
            return False
        if _is_ip(name) or name == "localhost" or name == self.bound_host.lower():
            return True
        return name in {h.lower() for h in self.allowed_hosts}

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in {o.rstrip("/") for o in self.allowed_origins}


class Guard:
    """ASGI middleware applying GuardConfig to every HTTP request."""

    def __init__(self, app, config: GuardConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        if not self.config.host_allowed(headers.get("host")):
            return await _refuse(send, 400, "invalid_host", scope["path"],
                                 f"Host {headers.get('host')!r} does not name this server: add it to --allowed-hosts")  # fmt: skip
        origin = headers.get("origin")
        if origin is not None and self.config.same_origin(origin, scope.get("scheme", "http"), headers.get("host")):
            origin = None  # the page this server served at / (browsers send Origin on its POSTs): no CORS involved
        if origin is not None and not self.config.origin_allowed(origin):
            return await _refuse(send, 403, "origin_not_allowed", scope["path"],
                                 f"requests from the web origin {origin!r} are not allowed: see --allowed-origins")  # fmt: skip
        if origin is not None and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return await self._preflight(send, origin)
        if scope["method"] == "POST" and not _is_json(headers.get("content-type")):
            return await _refuse(send, 415, "unsupported_media_type", scope["path"],
                                 "POST bodies must be sent with 'Content-Type: application/json'")  # fmt: skip
        if origin is None:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors(origin)]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)

    async def _preflight(self, send, origin: str) -> None:
        allow = ", ".join(self.config.cors_headers)
        extra = [(b"access-control-allow-methods", ALLOWED_METHODS.encode()),
                 (b"access-control-allow-headers", allow.encode()),
                 (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": 204, "headers": [*_cors(origin), *extra]})
        await send({"type": "http.response.body", "body": b""})


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _hostname(host_header: str) -> str | None:
    """The name in a Host header, lower-cased, without the port; None if it is malformed."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return name or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media, *params = [p.strip().lower() for p in content_type.split(";")]
    charset = next((p.split("=", 1)[1].strip('"') for p in params if p.startswith("charset=")), "utf-8")
    return media == "application/json" and charset in ("utf-8", "utf8")


def _cors(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _refuse(send, status: int, code: str, path: str, message: str) -> None:
    from kvlab.server.errors import APIError, error_body  # in the shape of the API the path belongs to

    body = error_body(path, APIError(status, message, code=code))
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
