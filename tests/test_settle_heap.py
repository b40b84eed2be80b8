"""kvlab.llm.settle_heap: a process that holds one model freezes what is alive after its load (gc.freeze) and
keeps freed memory for the next buffers (keep_freed_memory), unless KVLAB_GC_FREEZE=0 (this test process,
which loads many models)."""

from __future__ import annotations

import gc
import platform

import pytest

import kvlab.llm
from kvlab.llm import keep_freed_memory, settle_heap


def test_freezes_unless_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(kvlab.llm, "keep_freed_memory", lambda: calls.append("keep") or True)
    monkeypatch.setenv("KVLAB_GC_FREEZE", "0")
    assert settle_heap() is False and calls == []
    monkeypatch.setenv("KVLAB_GC_FREEZE", "1")
    assert settle_heap() is True and calls == ["freeze", "keep"]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_glibc_takes_the_thresholds():
    assert keep_freed_memory() is True


def test_the_test_process_has_it_off():
    import os

    assert os.environ["KVLAB_GC_FREEZE"] == "0"
