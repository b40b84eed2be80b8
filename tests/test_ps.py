"""`kvlab ps` against a server on loopback (GET /api/ps), and the server's one log line per request."""

from __future__ import annotations

import json
import logging

from kvlab.cli import main
from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)


def test_ps_shows_what_the_server_holds(llm, capsys):  # noqa: F811
    with serving(llm) as server:
        server.complete("The capital", max_tokens=3)  # its blocks stay findable: the prefix cache holds some
        assert main(["ps", "--url", server.url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        model = data["models"][0]
        k = model["kvlab"]
        assert model["name"] == "tiny" and model["context_length"] == 256
        assert k["weight_bytes"] == llm.loaded.weight_bytes and k["kv_pool_bytes"] == llm.engine.cache.nbytes()
        assert model["size"] == k["weight_bytes"] + k["kv_pool_bytes"] and model["size_vram"] == 0
        assert k["kv_blocks_total"] == llm.engine.kv.pool.counts().total and k["device"] == "cpu"
        assert k["vocab_size"] == 512 and model["details"]["family"] == "llama"
        assert k["kv_blocks_used"] == 0 and k["requests_running"] == 0 == k["requests_waiting"]
        assert main(["ps", "--url", server.url]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[:4] == ["NAME", "SIZE", "PROCESSOR", "CONTEXT"]
        assert table[1].startswith("tiny ") and "256" in table[1] and "0 running, 0 waiting" in table[1]


def test_ps_without_a_server_is_one_line(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["ps", "--url", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no kvlab server answers" in err and "kvlab serve MODEL" in err


def test_ps_needs_the_key_of_a_server_that_has_one(llm, capsys):  # noqa: F811
    with serving(llm, api_keys=("secret",)) as server:
        assert main(["ps", "--url", server.url]) == 2
        assert "wants an API key" in capsys.readouterr().err
        assert main(["ps", "--url", server.url, "--api-key", "secret"]) == 0


def test_every_request_gets_an_access_line(llm, caplog):  # noqa: F811
    with serving(llm) as server, caplog.at_level(logging.INFO, logger="kvlab.access"):
        server.complete("The capital", max_tokens=2)
        r = server.post("/v1/chat/completions", {"model": "tiny", "stream": True, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 200
        assert server.post("/v1/completions", {"model": "nope", "prompt": "x"}).status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvlab.access"]
    assert len(lines) == 3, lines
    assert '"POST /v1/completions" 200, ' in lines[0] and "prompt tokens" in lines[0] and "→ 2, TTFT " in lines[0]
    assert '"POST /v1/chat/completions" 200 stream, ' in lines[1] and lines[1].endswith(", length")
    assert lines[2].startswith("127.0.0.1:") and lines[2].endswith('"POST /v1/completions" 404')
