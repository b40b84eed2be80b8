"""The page at / in a real browser (issue 17): Playwright driving Debian's chromium on a tiny model.

    chat: streamed text, the answer's own timings, a second turn served from the prefix cache,
          stop mid-answer and the KV gauge back to idle; the pane following the conversation (and
          keeping a reader's place when they scroll up); the calculator's bytes equal `kvlab mem
          --json`'s, the served model's in its engine's KV format; the positions picture's counts;
          phone width; zero console errors

Playwright's own browser download cannot work offline, so it drives /usr/bin/chromium (`make test`
installs Debian's package where it is missing); without it, or without the playwright package,
these tests are skipped, saying why.

Screenshots for the README, against a running `kvlab serve` (a real model reads better):

    .venv/bin/python tests/test_web_browser.py http://127.0.0.1:8000 docs/ [desktop] [phone]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
# As root in a sandboxed machine with a closed network: no sandbox, no GPU, and none of Chromium's
# own connections (they would be refused, many at a time, and slow every start).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
STEP_DELAY_S = 0.03  # each engine step sleeps this long: a tiny model's answer must last long enough to stop
TIMEOUT_MS = 20_000


@contextlib.contextmanager
def chromium(viewport=(1280, 900)):
    """A fresh browser context (a new, empty profile each time) on the system's chromium."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="kvlab-chromium-") as profile, sync_playwright() as p:
        # Playwright takes the profile as user_data_dir and passes it to chromium as --user-data-dir
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": viewport[0], "height": viewport[1]},
        )  # fmt: skip
        context.set_default_timeout(TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()


def _skip_reason() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"no browser: {CHROMIUM} is missing (make test installs Debian's chromium with apt-get, as root)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[dev]')"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def slow_llm(tiny_chat_model, one_thread):
    from kvlab import LLM

    llm = LLM(tiny_chat_model, max_model_len=512)
    step = llm.engine.step

    def slow_step():  # the engine thread calls engine.step(): each step a little longer, tokens unchanged
        import time

        time.sleep(STEP_DELAY_S)
        return step()

    llm.engine.step = slow_step
    return llm


def open_page(context, url: str):
    """The page, loaded and started, with every console error and uncaught exception collected."""
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.goto(url)
    page.wait_for_selector("body[data-ready=true]")
    return page, errors


def open_sampling(page) -> None:
    """Unfold the chat's sampling settings (a <details> element, closed at first)."""
    page.click(".settings summary")
    page.wait_for_selector("#max-tokens", state="visible")


def send(page, text: str) -> None:
    """Type a message and send it with the keyboard (Enter), as a user would."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_streams_explains_each_answer_and_stops(slow_llm):
    from loopback import serving

    with serving(slow_llm) as s, chromium() as context:
        page, errors = open_page(context, s.url)
        open_sampling(page)
        page.fill("#max-tokens", "12")
        page.check("#ignore-eos")
        # record every text the first answer shows while it streams
        page.evaluate("""() => { window.seen = []; new MutationObserver(() => {
            const a = document.querySelector('li.answer');
            if (a && a.dataset.status === 'streaming') window.seen.push(a.querySelector('.text').textContent);
          }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
        send(page, "The capital of France is")
        first = page.locator("li.answer").nth(0)
        first.and_(page.locator("[data-status=done]")).wait_for()
        seen = [t for t in page.evaluate("window.seen") if t]
        assert len(set(seen)) >= 2 and all(first.locator(".text").inner_text().startswith(t) for t in seen)
        timing = first.evaluate("a => ({...a.dataset})")
        assert float(timing["ttftS"]) > 0 and int(timing["generatedTokens"]) == 12
        assert int(timing["cachedPromptTokens"]) == 0 and int(timing["prefillChunks"]) >= 1
        assert int(timing["kvCacheBytes"]) > 0
        caption = first.locator(".timeline figcaption").inner_text()
        assert "TTFT" in caption and "tok/s" in caption and "from the prefix cache" in caption

        send(page, "And of Italy?")  # the same conversation: the first turn's tokens are in the cache
        second = page.locator("li.answer").nth(1)
        second.and_(page.locator("[data-status=done]")).wait_for()
        cached = int(second.get_attribute("data-cached-prompt-tokens"))
        assert 0 < cached < int(second.get_attribute("data-prompt-tokens"))
        assert f"{cached} of" in second.locator(".fact.cached").inner_text()

        page.click("#clear")
        page.fill("#max-tokens", "400")
        send(page, "Count to a thousand")
        long = page.locator("li.answer").nth(0)
        page.wait_for_function("() => document.querySelector('li.answer .text').textContent.length > 0")
        page.wait_for_selector("#pool-gauge[data-idle=false]")  # the poll saw the request hold blocks
        page.click("#stop")
        long.and_(page.locator("[data-status=stopped]")).wait_for()
        page.wait_for_selector("#pool-gauge[data-idle=true]")  # aborted: every block back in the pool
        assert page.get_attribute("#pool-gauge", "data-used") == "0"
        s.wait_idle()  # the server agrees: no request, no block held, the pool and the ledger balanced
        assert int(page.inner_text("#running")) == 0
        assert errors == []


IN_PANE = """([selector, index]) => {  // is the element wholly inside the chat pane's visible area?
    const pane = document.getElementById('messages').getBoundingClientRect();
    const node = document.querySelectorAll(selector)[index].getBoundingClientRect();
    return node.height > 0 && node.top >= pane.top - 1 && node.bottom <= pane.bottom + 1;
}"""


def in_pane(page, selector: str, index: int = -1) -> bool:
    """Whether the `index`-th match of `selector` (the last by default) shows whole inside the chat pane."""
    count = page.locator(selector).count()
    return page.evaluate(IN_PANE, [selector, index % count])


def pane_scroll(page) -> dict:
    return page.evaluate("""() => { const m = document.getElementById('messages');
        return {top: m.scrollTop, height: m.scrollHeight, client: m.clientHeight}; }""")


def settled_scroll_top(page) -> float:
    """The pane's scrollTop once a wheel's scrolling has come to rest (it may be animated)."""
    last = None
    while (top := pane_scroll(page)["top"]) != last:
        last = top
        page.wait_for_timeout(150)
    return top


def test_the_chat_pane_follows_the_conversation_unless_the_reader_scrolls_up(slow_llm):
    """Issue 31: the newest message, its timings and the Stop note stay in view as the pane overflows;
    a reader who scrolls up mid-answer keeps their place, and scrolling back down follows again."""
    from loopback import serving

    with serving(slow_llm) as s, chromium((1000, 450)) as context:  # a short window: the pane is 60% of it
        page, errors = open_page(context, s.url)
        open_sampling(page)
        page.fill("#max-tokens", "24")
        page.check("#ignore-eos")
        # after every change the streaming answer makes, is its live line (under the text) in view?
        page.evaluate("() => { window.views = []; const seen = " + IN_PANE + """;
            new MutationObserver(() => {
              const lives = document.querySelectorAll('li.answer[data-status=streaming] .live');
              if (lives.length) window.views.push(seen(['li.answer[data-status=streaming] .live', 0]));
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
          }""")
        for turn in range(3):
            send(page, f"Story {turn + 1}, please.")
            answer = page.locator("li.answer").nth(turn)
            answer.and_(page.locator("[data-status=done]")).wait_for()
            answer.locator(".timeline figcaption").wait_for()
            assert in_pane(page, "li.answer .timeline figcaption")  # the answer's timings, in view
        scroll = pane_scroll(page)
        assert scroll["height"] > scroll["client"] + 200 and scroll["top"] > 0  # it overflows, and it followed
        views = page.evaluate("window.views")
        assert len(views) >= 3 * 5 and all(views)  # mid-stream, every piece of text was shown as it came

        page.fill("#max-tokens", "200")  # the conversation so far is ~200 tokens of the 512 of the context
        send(page, "One more, a long one.")
        text = "() => document.querySelectorAll('li.answer')[3].querySelector('.text').textContent.length"
        page.wait_for_function(f"{text} > 5")
        assert in_pane(page, "li.answer .live")
        page.hover("#messages")
        page.mouse.wheel(0, -300)  # the reader scrolls up, to read an earlier answer again
        kept = settled_scroll_top(page)
        assert kept < pane_scroll(page)["height"] - pane_scroll(page)["client"] - 100
        shown = page.evaluate(text)
        page.wait_for_function(f"{text} > {shown + 8}")  # more text arrived meanwhile ...
        assert pane_scroll(page)["top"] == kept and not in_pane(page, "li.answer .live")  # ... and the place held

        page.mouse.wheel(0, 100_000)  # back down to the end: the pane follows again
        settled_scroll_top(page)
        shown = page.evaluate(text)
        page.wait_for_function(f"{text} > {shown + 5}")
        assert in_pane(page, "li.answer .live")
        page.click("#stop")
        stopped = page.locator("li.answer").nth(3)
        stopped.and_(page.locator("[data-status=stopped]")).wait_for()
        assert stopped.locator(".live").inner_text().startswith("stopped")
        assert in_pane(page, "li.answer .live")  # the Stop note, in view
        assert errors == []


def test_the_calculator_and_the_picture_are_kvlab_memorys(slow_llm, capsys):
    from loopback import serving

    from kvlab.cli import main
    from kvlab.memory import pairs_with_cache, pairs_without_cache

    with serving(slow_llm) as s, chromium() as context:
        page, errors = open_page(context, s.url)
        # first the served model, its KV in the format the server's cache holds (issue 31)
        page.wait_for_selector("#calc-result[data-config='served'][data-context='4096']")
        per_token = slow_llm.engine.cache.bytes_per_token()
        assert int(page.get_attribute("#calc-kv", "data-bytes")) == 4096 * per_token
        assert "KV in float32" in page.inner_text("#calc-result caption")
        assert "KV sized in float32: the format the served engine's cache holds" in page.inner_text("#calc-result")
        assert page.inner_text("#calc-dtype option[value=auto]") == "auto (what the server holds: float32)"
        page.select_option("#calc-config", "qwen3-0.6b")
        page.fill("#calc-device", "24")
        page.wait_for_selector("#calc-result[data-config='qwen3-0.6b'][data-context='4096']")
        page.focus("#calc-context")
        page.keyboard.press("ArrowRight")  # the keyboard moves the slider: 4,096 → 8,192 tokens
        page.wait_for_selector("#calc-result[data-context='8192']")
        assert page.inner_text("#calc-context-out") == "8,192 tokens"
        capsys.readouterr()
        assert main(["mem", "qwen3-0.6b", "--context", "8192", "--device-memory", "24GiB", "--json"]) == 0
        expected = json.loads(capsys.readouterr().out)
        shown = page.evaluate("""() => Object.fromEntries(['kv', 'weights', 'workspace', 'total', 'usable']
            .map(k => [k, Number(document.getElementById('calc-' + k).dataset.bytes)]))""")
        assert shown == {"kv": expected["kv_bytes"], "weights": expected["weight_bytes"],
                         "workspace": expected["workspace_bytes"], "total": expected["total_bytes"],
                         "usable": expected["usable_bytes"]}  # fmt: skip
        assert int(page.get_attribute("#calc-max-batch", "data-value")) == expected["max_batch"]
        assert page.get_attribute("#calc-max-context", "data-value") == str(expected["max_context"])

        steps = page.locator("#pos-steps")
        assert steps.get_attribute("data-with-cache") == "36" and steps.get_attribute("data-without-cache") == "85"
        page.focus("#pos-n")
        page.keyboard.press("ArrowRight")  # n = 7, m = 2
        page.wait_for_selector(f"#pos-steps[data-with-cache='{pairs_with_cache(7, 2)}']")
        assert steps.get_attribute("data-without-cache") == str(pairs_without_cache(7, 2))
        assert page.locator("#pos-with rect").count() == 9 * 10 // 2  # one cell per pair of the 9 positions

        unnamed = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
            .filter(e => !e.hidden && !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                         && !e.textContent.trim()).map(e => e.id || e.outerHTML)""")
        assert unnamed == []  # every control has a name a screen reader can say
        page.set_viewport_size({"width": 390, "height": 844})
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than a phone
        assert errors == []


def test_the_page_asks_for_the_key_once(slow_llm):
    from loopback import serving

    with serving(slow_llm, api_keys=("sesame",)) as s, chromium() as context:
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(s.url)
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "sesame")
        page.press("#key-input", "Enter")
        page.wait_for_selector("body[data-ready=true]")
        page.wait_for_selector("#pool-gauge[data-total]")  # /metrics answered with the key
        open_sampling(page)
        page.fill("#max-tokens", "3")
        send(page, "hello")
        page.locator("li.answer[data-status=done]").wait_for()
        page.reload()  # the key is kept for this tab: no second question
        page.wait_for_selector("body[data-ready=true]")
        assert not page.locator("#key-dialog").evaluate("d => d.open")
        assert errors == []  # no request went out without the key


SHOTS = {"desktop": ("web-desktop.png", (1360, 1000)), "phone": ("web-phone.png", (390, 844))}


def screenshots(url: str, out: Path, which: list[str]) -> None:
    """docs/web-desktop.png (the whole page) and docs/web-phone.png (what a phone shows first): two turns
    of a conversation (on a fresh server the first misses the prefix cache and the second hits it)."""
    for name, viewport in (SHOTS[w] for w in which):
        with chromium(viewport) as context:
            page, errors = open_page(context, url)
            send(page, "What is the capital of France? Answer in one sentence.")
            page.locator("li.answer[data-status=done]").wait_for()
            send(page, "And of Italy?")
            page.locator("li.answer[data-status=done]").nth(1).wait_for()
            page.wait_for_timeout(2500)  # a few polls: the rate chart has points
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(out / name), full_page=viewport[0] > 800)
            if errors:
                raise SystemExit(f"console errors: {errors}")
            print(f"wrote {out / name}")


if __name__ == "__main__":
    screenshots(sys.argv[1], Path(sys.argv[2]), sys.argv[3:] or list(SHOTS))
