"""Time limits on the wire: a connection must send its request's headers in time, and idle ones close.

    connection opened, or a kept-alive one's next request begins ──► headers within header_timeout_s
                                                                   else 408, the socket closes
    headers in ──► the app: the body within body_timeout_s (body.py's read_body), else 408 and close
    response sent ──► the next request within keep_alive_timeout_s (uvicorn's timeout_keep_alive), else close

uvicorn (0.x, h11) waits for headers forever: a socket that sends half a request line and then
nothing — or nothing at all — is held until the client leaves. `TimedH11Protocol` is uvicorn's h11
protocol with one timer more: armed when a connection opens and when the first bytes of a next request
arrive, cancelled once the headers are complete (uvicorn has then started the request's cycle). The
408 is written by hand: no request was parsed, so h11 cannot answer it.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    header_timeout_s = 10.0  # set per server by `protocol_class` (ServerConfig.header_timeout_s)
    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # its headers are in: the app has the request

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        message = f"the request headers did not arrive within {self.header_timeout_s:g} s"
        self.transport.write(timeout_response(message))
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[TimedH11Protocol]:
    """uvicorn's `http=` protocol for one server, with its header limit."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})


def timeout_response(message: str) -> bytes:
    """A whole HTTP/1.1 408 in OpenAI's error shape, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()  # fmt: skip
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))  # fmt: skip
    return head + body


def uvicorn_config(app, header_timeout_s: float, keep_alive_timeout_s: float, **options):
    """uvicorn's Config for `app` with these limits (h11 always: the header timer lives in its protocol)."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_class(header_timeout_s), timeout_keep_alive=keep_alive_timeout_s,
                          **options)  # fmt: skip
