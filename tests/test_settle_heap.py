"""kvlab.llm.settle_heap: a process that holds one model freezes what is alive after its load (gc.freeze),
unless KVLAB_GC_FREEZE=0 (this test process, which loads many models)."""

from __future__ import annotations

import gc

from kvlab.llm import settle_heap


def test_freezes_unless_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setenv("KVLAB_GC_FREEZE", "0")
    assert settle_heap() is False and calls == []
    monkeypatch.setenv("KVLAB_GC_FREEZE", "1")
    assert settle_heap() is True and calls == ["freeze"]


def test_the_test_process_has_it_off():
    import os

    assert os.environ["KVLAB_GC_FREEZE"] == "0"
