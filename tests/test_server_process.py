"""`kvlab serve` as a process: the port is bound before the model loads, SIGTERM stops it like Ctrl-C,
and an engine that dies takes the process down with it (so that a supervisor restarts it)."""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvlab import LLM
from loopback import serving


def test_a_port_in_use_is_a_one_line_error_before_loading(tiny_chat_model, capsys):
    from kvlab.cli import main

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code = main(["serve", str(tiny_chat_model), "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err  # no memory plan printed: nothing was loaded
    assert err[0].startswith("kvlab: error: cannot listen on 127.0.0.1:") and "in use" in err[0]


def test_the_listening_socket_lets_asyncio_turn_nagle_off():
    """asyncio sets TCP_NODELAY only on connections of an IPPROTO_TCP socket (proto 0 is skipped):
    without it, each answer on a kept-alive connection waited for the client's delayed ACK."""
    import asyncio

    from kvlab.server.cli import listen

    sock = listen("127.0.0.1", 0)

    async def accept_one() -> int:
        accepted = asyncio.get_running_loop().create_future()

        def connected(reader, writer):
            s = writer.get_extra_info("socket")
            accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(connected, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await accepted
            writer.close()
        return nodelay

    assert sock.proto == socket.IPPROTO_TCP
    assert asyncio.run(accept_one()) != 0


def _serve(model) -> tuple[subprocess.Popen, str, queue.Queue]:
    """Start `kvlab serve` on a free port; return it, its URL, and its stderr lines as they come."""
    cmd = [sys.executable, "-m", "kvlab.cli", "serve", str(model), "--port", "0", "--kv-memory", "1MiB",
           "--max-model-len", "256", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    while True:
        line = lines.get(timeout=120)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            return proc, found.group(1), lines


def _rest(lines: queue.Queue) -> str:
    out = []
    while not lines.empty():
        out.append(lines.get())
    return "".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_the_server_cleanly(tiny_chat_model, sig):
    proc, url, lines = _serve(tiny_chat_model)
    try:
        body = {"model": str(tiny_chat_model), "prompt": "hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    time.sleep(0.1)  # the reader thread's last lines
    assert code == 0 and "kvlab serve: stopped" in _rest(lines)


def test_an_engine_that_dies_fails_its_requests_says_so_on_health_and_calls_on_death(tiny_chat_model, monkeypatch):
    llm = LLM(tiny_chat_model, max_model_len=128)  # its own: this engine is left broken
    with serving(llm) as s:
        died = threading.Event()
        s.engine.on_death = lambda error: died.set()

        def broken_pool():  # what LLMEngine.step raises when the KV pool's integrity fails
            raise AssertionError("free queue != blocks nobody holds")

        monkeypatch.setattr(llm.engine, "step", broken_pool)
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert died.wait(10)
        health = s.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "engine stopped"}
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
