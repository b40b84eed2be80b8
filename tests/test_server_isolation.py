"""No client can read another's prompt: prefix-cache salts and tenants (issue 9, point 4), over loopback.

`cached_prompt_tokens` is the side channel: a client that guesses another's prompt token by token
would see the count grow on a right guess. Under different salts or tenants it stays 0.
"""

from __future__ import annotations

import pytest

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

A, B = "key-a", "key-b"


def cached(server, prompt: str, key: str | None = "default", headers: dict | None = None, **fields) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **fields}
    r = server.post("/v1/completions", body, key=key, headers=headers)
    assert r.status_code == 200, r.text
    out = r.json()
    n = out["kvlab"]["cached_prompt_tokens"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == n  # OpenAI's field says the same
    return n


def prompt(tag: str) -> str:
    return f"{tag}: the capital of France is Paris, and the capital of Japan is Tokyo. " * 2


def test_cache_salt_splits_the_prefix_cache(llm):
    with serving(llm) as s:
        p = prompt("salt")
        assert cached(s, p, cache_salt="alice") == 0
        assert cached(s, p, cache_salt="bob") == 0  # bob learns nothing about alice's prompt
        assert cached(s, p) == 0  # nor does an unsalted request
        assert cached(s, p, cache_salt="alice") > 16  # alice shares with herself
        r = s.post("/v1/completions", {"model": "tiny", "prompt": p, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        s.assert_still_serving()


def test_guessing_another_tenants_prompt_shows_nothing(llm):
    """The issue's attack: tenant B guesses the last digit of tenant A's prompt."""
    with serving(llm, api_keys=(A, B)) as s:
        secret = "Customer record. Account holder: J. Smith. Card number 4111 1111 1111 111"
        assert cached(s, secret + "7", key=A) == 0
        assert cached(s, secret + "7", key=B) == 0  # the right guess, first: nothing of A's is found
        wrong = {cached(s, secret + d, key=B) for d in "0123456789" if d != "7"}
        assert len(wrong) == 1  # every later guess finds only B's own earlier guesses, right or wrong alike
        assert cached(s, secret + "7", key=B) == wrong.pop()
        assert cached(s, secret + "7", key=A) > 16  # A's own repeat still hits
        s.assert_still_serving()


@pytest.mark.parametrize("by", ["header", "user"])
def test_tenants_by_header_or_user_field(llm, by):
    with serving(llm, cache_salt_by=by) as s:
        p = prompt(by)

        def ask(tenant):
            if by == "header":
                return cached(s, p, headers={"X-Tenant-Id": tenant})
            return cached(s, p, user=tenant)

        assert ask("t1") == 0
        assert ask("t2") == 0
        assert ask("t1") > 16
        s.assert_still_serving()


def test_without_isolation_every_client_shares(llm):
    with serving(llm, api_keys=(A, B), cache_salt_by="none") as s:
        p = prompt("shared")
        first = cached(s, p, key=A)  # (a token or two may match what earlier tests sent unsalted)
        assert cached(s, p, key=B) > max(first, 16)  # documented: one tenant, everything shared
        s.assert_still_serving()


def test_identical_requests_do_not_pile_up_cached_blocks(llm):
    with serving(llm) as s:
        p = prompt("same")
        body = {"model": "tiny", "prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        assert s.post("/v1/completions", body).status_code == 200
        s.wait_idle()
        blocks = llm.engine.kv.pool.check_integrity().cached
        for _ in range(4):
            assert s.post("/v1/completions", body).status_code == 200
            s.wait_idle()
            assert llm.engine.kv.pool.check_integrity().cached == blocks
        s.assert_still_serving()
