"""Fair and honest under abuse (issue 29): time limits on the wire, admission by cost, a fair queue, the drain.

Each case runs a server on loopback with uvicorn's config as `kvlab serve` builds it (wire.py: the
header timer, the keep-alive limit) and ends with a normal request that succeeds. Raw sockets play
the abusive clients; every read has a deadline.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from loopback import Served

HOLD_S = 30  # the most any step of these tests waits for something that should happen in well under a second


@pytest.fixture(scope="module")
def llm(tiny_chat_model, one_thread):
    """The tiny chat model; two running sequences at most, so that seats are contended."""
    from kvlab import LLM

    return LLM(tiny_chat_model, max_model_len=256, max_num_seqs=2)


@contextmanager
def wire_serving(llm, graceful: bool = False, **config):
    """A server as `kvlab serve` runs it (header timer, keep-alive limit; with `graceful`, its drain)."""
    import uvicorn

    from kvlab.server.app import ServerConfig, create_app
    from kvlab.server.async_engine import AsyncEngine
    from kvlab.server.cli import graceful_server, listen
    from kvlab.server.wire import uvicorn_config

    engine = AsyncEngine(llm.engine)
    server_config = ServerConfig(**{"model_name": "tiny", **config})
    app = create_app(llm, engine, server_config)
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv_config = uvicorn_config(app, server_config.header_timeout_s, server_config.keep_alive_timeout_s,
                               log_level="critical", timeout_graceful_shutdown=HOLD_S)  # fmt: skip
    server = graceful_server(uv_config, engine) if graceful else uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(1000):
        if server.started:
            break
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", llm, engine), server, thread
    finally:
        server.should_exit = True
        thread.join(HOLD_S)
        sock.close()
    assert engine.stopped.is_set()


def connect(served: Served) -> socket.socket:
    port = int(served.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=HOLD_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by HOLD_S)."""
    data, end = b"", time.monotonic() + HOLD_S
    while time.monotonic() < end:
        sock.settimeout(max(end - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server did not close the connection within {HOLD_S} s (got {data[:200]!r})")


def status_and_body(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request_head(body_len: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_len}\r\n\r\n").encode()  # fmt: skip


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "The capital", "max_tokens": 3, "temperature": 0, **fields}


# ---- 1. time limits on the wire ---------------------------------------------------------------------


def test_silent_uploads_hold_no_slot_and_get_408_then_the_socket_closes(llm):
    with wire_serving(llm, max_concurrent_requests=2, body_timeout_s=1.5) as (s, _, _):
        uploads = [connect(s) for _ in range(4)]  # twice the slots
        for sock in uploads:
            sock.sendall(request_head(100_000) + b'{"model": "ti')  # a few bytes of 100,000, then nothing
        for _ in range(3):  # meanwhile real requests are served: the uploads hold no slot
            assert s.complete()["usage"]["completion_tokens"] >= 1
        for sock in uploads:
            status, body = status_and_body(read_until_closed(sock))
            assert status == 408 and body["error"]["code"] == "request_timeout"
            assert "did not arrive within 1.5 s" in body["error"]["message"]
            sock.close()
        s.assert_still_serving()


def test_slow_headers_and_silent_connections_get_408_and_close(llm):
    with wire_serving(llm, header_timeout_s=1.0) as (s, _, _):
        silent, partial = connect(s), connect(s)
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finish
        for sock in (silent, partial):
            status, body = status_and_body(read_until_closed(sock))
            assert status == 408 and "headers did not arrive within 1 s" in body["error"]["message"]
            sock.close()
        s.assert_still_serving()


def test_a_whole_request_sent_in_pieces_within_the_limits_is_served(llm):
    with wire_serving(llm, header_timeout_s=5.0, body_timeout_s=5.0) as (s, _, _):
        body = json.dumps(completion()).encode()
        sock = connect(s)
        head = request_head(len(body)).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        for piece in (head[:20], head[20:], body[:10], body[10:]):
            sock.sendall(piece)
            time.sleep(0.1)
        status, answer = status_and_body(read_until_closed(sock))
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1
        sock.close()
        s.assert_still_serving()


def test_kept_alive_connections_close_when_idle_and_time_out_a_slow_next_request(llm):
    with wire_serving(llm, header_timeout_s=1.0, keep_alive_timeout_s=0.5) as (s, _, _):
        body = json.dumps(completion()).encode()
        idle = connect(s)
        idle.sendall(request_head(len(body)) + body)
        response = read_until_closed(idle)  # answered, then closed once idle for 0.5 s
        assert response.startswith(b"HTTP/1.1 200")
        idle.close()
        slow = connect(s)
        slow.sendall(request_head(len(body)) + body)
        first = b""
        while b'"usage"' not in first:  # the first answer, whole
            chunk = slow.recv(65536)
            assert chunk, "closed before answering"
            first += chunk
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # the next request starts, its headers never end
        status, error = status_and_body(read_until_closed(slow))
        assert status == 408 and error["error"]["code"] == "request_timeout"
        slow.close()
        s.assert_still_serving()


# ---- 2. admission by cost ---------------------------------------------------------------------------


def test_a_request_counts_its_sequences_and_tokens(llm):
    with wire_serving(llm, max_queued_seqs=4, max_queued_tokens=300) as (s, _, _):
        r = s.post("/v1/completions", completion(prompt=["a", "b", "c", "d", "e"]))
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
        r = s.post("/v1/completions", completion(prompt=["a", "b", "c"], n=2))  # 3 prompts × 2 choices
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
        r = s.post("/v1/completions", completion(prompt=["a", "b"], max_tokens=200))  # 2 × (≥ 1 + 200) tokens
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens"
        ok = s.post("/v1/completions", completion(prompt=["a", "b"], n=2))  # 4 sequences: exactly the limit
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        s.assert_still_serving()


def test_requests_beyond_the_sequences_in_flight_get_429_with_retry_after(llm, monkeypatch):
    gate = threading.Event()
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (gate.wait(HOLD_S), step())[1])  # the engine waits for us
    with wire_serving(llm, max_queued_seqs=4) as (s, _, _):
        held = threading.Thread(target=lambda: s.post("/v1/completions", completion(prompt=["a", "b", "c"])))
        held.start()
        for _ in range(1000):  # until its three sequences are in the engine
            if s.engine.num_in_flight() == 3:
                break
            time.sleep(0.01)
        r = s.post("/v1/completions", completion(prompt=["x", "y"]))  # 3 + 2 > 4
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
        assert r.headers["retry-after"] == "1" and "sequences" in r.json()["error"]["message"]
        gate.set()
        held.join(HOLD_S)
        monkeypatch.undo()
        s.assert_still_serving()


# ---- 2. the fair queue ------------------------------------------------------------------------------


def test_a_small_request_is_answered_while_a_giant_one_runs_and_greedy_text_is_unchanged(llm):
    prompts = [f"prompt number {i} says" for i in range(8)]
    with wire_serving(llm) as (s, _, _):
        alone = [s.complete(p, max_tokens=40, ignore_eos=True)["choices"][0]["text"] for p in prompts[:3]]
        small_alone = s.complete("hello", max_tokens=2)["choices"][0]["text"]
        order: list[str] = []
        giant_body = completion(prompt=prompts, max_tokens=40, ignore_eos=True, stream=True)
        giant_text: dict[int, str] = {}

        def giant() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", json=giant_body, timeout=HOLD_S * 4) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            giant_text[c["index"]] = giant_text.get(c["index"], "") + c["text"]
                            if len(order) == 0:
                                order.append("giant started")
            order.append("giant done")

        thread = threading.Thread(target=giant)
        thread.start()
        for _ in range(3000):
            if order:
                break
            time.sleep(0.01)
        small = s.complete("hello", max_tokens=2)  # 8 prompts hold both seats: it takes one (fair.py)
        order.append("small done")
        thread.join(HOLD_S * 4)
        assert order == ["giant started", "small done", "giant done"]
        assert small["choices"][0]["text"] == small_alone  # greedy: the same tokens as alone
        assert [giant_text[i] for i in range(3)] == alone
        # the small request usually takes its seat by preempting one of the giant's sequences, but one that
        # arrives as a giant sequence finishes gets the freed seat instead: the order above is the claim
        s.assert_still_serving()


# ---- the drain ----------------------------------------------------------------------------------------


def test_during_a_drain_new_requests_and_health_get_503_then_the_server_stops(llm, monkeypatch):
    import signal

    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (time.sleep(0.05), step())[1])  # ~20 steps a second
    with wire_serving(llm, graceful=True) as (s, server, thread):
        body = completion(max_tokens=60, ignore_eos=True, stream=True)
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=HOLD_S) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # it runs
            server.handle_exit(signal.SIGTERM, None)
            health = httpx.get(s.url + "/health", timeout=HOLD_S)  # a new connection: answered, not refused
            assert health.status_code == 503 and health.json() == {"status": "shutting down"}
            r = s.post("/v1/completions", completion())
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]  # the running one finished
        thread.join(HOLD_S)
        assert not thread.is_alive()  # then the server stopped by itself
    monkeypatch.undo()
    with wire_serving(llm) as (s, _, _):
        s.assert_still_serving()
