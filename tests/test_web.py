"""The page `kvlab serve` answers at / and its endpoints, over loopback, without a browser (issue 17).

The page is static files shipped in the package; the calculator's numbers are `kvlab mem --json`'s;
the page obeys the API's rules (the key, the Host, same-origin requests). tests/test_web_browser.py
drives the page itself in Chromium.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import httpx
import pytest
from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "kvlab" / "server" / "static"
KEY = "page-key"


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm) as s:
        yield s


def kvlab_mem_json(capsys, *args: str) -> dict:
    """What `kvlab mem ... --json` prints, run in this process."""
    from kvlab.cli import main

    capsys.readouterr()
    assert main(["mem", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_page_and_every_file_it_loads_are_served_from_the_package(server):
    page = httpx.get(server.url + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp  # nothing from elsewhere, no inline script
    # every module the page imports, transitively, answers with JavaScript
    pending, seen = ["/static/main.js"], set()
    while pending:
        path = pending.pop()
        seen.add(path)
        r = httpx.get(server.url + path, timeout=30)
        assert r.status_code == 200 and "javascript" in r.headers["content-type"], path
        imported = {f"/static/{name}" for name in re.findall(r'from "\./([\w.]+)"', r.text)}
        pending += sorted(imported - seen)
    assert seen == {f"/static/{p.name}" for p in STATIC.glob("*.js")}  # no file shipped that nothing loads
    assert httpx.get(server.url + "/static/style.css", timeout=30).status_code == 200
    assert httpx.get(server.url + "/static/nothing.js", timeout=30).status_code == 404


def test_no_file_of_the_page_reaches_beyond_its_server():
    for path in STATIC.iterdir():
        addresses = set(re.findall(r"\w+://[^\s\"'`)]+", path.read_text()))
        assert addresses <= {"http://www.w3.org/2000/svg"}, (path.name, addresses)  # the SVG namespace is a name


def test_the_static_files_are_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvlab"]
    for path in STATIC.iterdir():
        relative = path.relative_to(ROOT / "kvlab").as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs), f"{relative} would be missing from a wheel"


@pytest.mark.parametrize("config, args", [
    ("qwen3-0.6b", ["--context", "8192", "--batch", "4", "--kv-dtype", "fp8", "--device-memory", "24GiB"]),
    ("gemma-3-27b", ["--context", "131072", "--batch", "1"]),
    ("qwen3.5-9b", ["--context", "1024", "--batch", "16", "--kv-dtype", "q8_0", "--device-memory", "8GiB"]),
])  # fmt: skip
def test_the_calculator_answers_what_kvlab_mem_prints(server, capsys, config, args):
    flags = dict(zip(args[::2], args[1::2]))
    query = {"config": config, "context": flags["--context"], "batch": flags["--batch"],
             "kv_dtype": flags.get("--kv-dtype", "auto"), "n": 6, "m": 2}  # fmt: skip
    if "--device-memory" in flags:
        query["device_bytes"] = int(flags["--device-memory"].removesuffix("GiB")) * 2**30
    r = server.get("/api/web/memory?" + str(httpx.QueryParams(query)))
    assert r.status_code == 200, r.text
    answer = r.json()
    expected = kvlab_mem_json(capsys, config, *args, "--pairs", "6", "2")
    steps = answer["pairs"].pop("steps")
    assert answer == expected
    assert answer["pairs"]["with_cache"] == 36 and answer["pairs"]["without_cache"] == 85  # seed 004's n=6, m=2
    assert steps == [{"positions": 6, "with_cache": 21, "without_cache": 21},
                     {"positions": 7, "with_cache": 7, "without_cache": 28},
                     {"positions": 8, "with_cache": 8, "without_cache": 36}]  # fmt: skip


def test_the_served_models_config_is_the_one_kvlab_mem_reads(server, capsys, tiny_chat_model):
    r = server.get("/api/web/memory?config=served&context=200&batch=3")
    expected = kvlab_mem_json(capsys, str(tiny_chat_model), "--context", "200", "--batch", "3")
    [served] = r.json()["models"]
    # the same figures; only the reason for the KV format differs (this server's cache / what `kvlab run` keeps)
    assert served["notes"][0] == "KV sized in float32: the format the served engine's cache holds"
    assert expected["notes"][0].startswith("KV sized in float32: what `kvlab run` keeps")
    assert served["source"] == Path(expected["source"]).name  # the file's name, never its path on the server
    same = {"notes": None, "source": None}
    assert {**served, **same} == {**expected, **same} and served["notes"][1:] == expected["notes"][1:]
    assert served["kv_bytes_per_token"] == server.llm.engine.cache.bytes_per_token()
    info = server.get("/api/web/model").json()
    assert info["served_kv_dtype"] == "float32"
    assert info["model"] == "tiny" and info["has_chat_template"] and info["max_model_len"] == 256
    assert info["configs"][0] == "served" and "qwen3-0.6b" in info["configs"]
    assert "auto" in info["kv_dtypes"] and "fp8" in info["kv_dtypes"]
    assert info["device"] == "cpu" and info["device_memory_bytes"] > 2**20
    assert info["kv_blocks_total"] == server.llm.engine.kv.pool.counts().total


def test_the_served_entry_sizes_the_kv_format_the_engine_really_holds(tiny_chat_model, one_thread):
    """Keys in fp8_e4m3 (a float32 scale per vector), values in float32: "auto" for the served model is what
    this engine's cache allocates per token, K and V apart, and its note names that format (issue 31)."""
    from kvlab import LLM

    mixed = LLM(tiny_chat_model, max_model_len=256, cache_type_k="fp8_e4m3", kv_memory_bytes=1 << 20)
    with serving(mixed) as s:
        [report] = s.get("/api/web/memory?config=served&context=100&kv_dtype=auto").json()["models"]
        info = s.get("/api/web/model").json()
        [half] = s.get("/api/web/memory?config=served&context=100&kv_dtype=float16").json()["models"]
    cache = mixed.engine.cache
    assert (cache.formats.k.name, cache.formats.v.name) == ("fp8_e4m3", "float32")
    assert report["kv_dtype"] == info["served_kv_dtype"] == "fp8_e4m3:float32"
    # 3 layers x 2 KV heads x (16 fp8 codes + a 4-byte scale, then 16 float32 numbers)
    assert report["kv_bytes_per_token"] == cache.bytes_per_token() == 3 * 2 * (16 + 4 + 16 * 4)
    assert report["kv_bytes"] == 100 * cache.bytes_per_token()
    assert report["notes"][0] == "KV sized in fp8_e4m3:float32: the format the served engine's cache holds"
    # a format chosen in the page is sized as chosen, with nothing to explain
    assert half["kv_dtype"] == "float16" and half["kv_bytes_per_token"] == 3 * 2 * 2 * 16 * 2
    assert not any(note.startswith("KV sized in") for note in half["notes"])


@pytest.mark.parametrize("query, says", [
    ("config=/etc/passwd", "unknown config"),
    ("config=smollm2-135m", "unknown config"),  # a registry name: the page must never make the server pull
    ("context=abc", "context must be a whole number"),
    ("batch=-1", "batch must be a whole number"),
    ("n=40&m=30", "positions picture"),
    ("n=0&m=0", "at least one position"),
    ("kv_dtype=int3", "unknown KV dtype"),
    ("device_bytes=0", "device_bytes must be at least 1"),
])  # fmt: skip
def test_the_calculator_refuses_what_it_cannot_answer(server, query, says):
    r = server.get("/api/web/memory?" + query)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_the_page_needs_the_key_for_everything_but_itself(llm):
    with serving(llm, api_keys=(KEY,)) as s:
        assert httpx.get(s.url + "/", timeout=30).status_code == 200  # the page holds no data
        assert httpx.get(s.url + "/static/main.js", timeout=30).status_code == 200
        assert s.get("/api/web/access", key=None).json() == {"api_key_required": True}
        for path in ("/api/web/model", "/api/web/memory", "/metrics"):
            assert s.get(path, key=None).status_code == 401, path
            assert s.get(path, key="wrong").status_code == 401, path
            assert s.get(path).status_code == 200, path
    with serving(llm) as s:
        assert s.get("/api/web/access").json() == {"api_key_required": False}


def test_a_page_of_this_server_may_post_and_other_origins_may_not(server):
    port = server.url.rsplit(":", 1)[1]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    own = server.post("/v1/chat/completions", body, headers={"Origin": server.url})
    assert own.status_code == 200 and "kvlab" in own.json()
    assert "access-control-allow-origin" not in own.headers  # same origin: no CORS involved
    other_port = server.post("/v1/chat/completions", body, headers={"Origin": "http://127.0.0.1:1"})
    other_name = server.post("/v1/chat/completions", body, headers={"Origin": f"http://localhost:{port}"})
    other_scheme = server.post("/v1/chat/completions", body, headers={"Origin": f"https://127.0.0.1:{port}"})
    for r in (other_port, other_name, other_scheme):
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    server.assert_still_serving()


def test_same_origin_needs_a_host_that_names_this_server():
    from kvlab.server.guard import GuardConfig

    named = GuardConfig(allowed_hosts=("kvlab.internal",))
    assert named.same_origin("http://127.0.0.1:8000", "http", "127.0.0.1:8000")
    assert named.same_origin("http://localhost:8000/", "http", "LOCALHOST:8000")
    assert named.same_origin("http://kvlab.internal:8000", "http", "kvlab.internal:8000")
    assert not named.same_origin("http://evil.example:8000", "http", "evil.example:8000")
    assert not named.same_origin("http://127.0.0.1:8000", "http", None)
    # `--allowed-hosts '*'` lets any Host in, a rebinding page's own name too: that page stays cross-site
    anything = GuardConfig(allowed_hosts=("*",))
    assert anything.host_allowed("evil.example:8000")
    assert not anything.same_origin("http://evil.example:8000", "http", "evil.example:8000")
