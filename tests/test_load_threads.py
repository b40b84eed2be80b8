"""LLM() loads with PyTorch on one thread (kvlab.llm.one_torch_thread), so that the load makes no OpenMP
team and the thread that steps the engine (kvlab serve's engine thread) owns the only one; the thread
count is given back afterwards, and the LLM's own policy still takes the count it found."""

from __future__ import annotations

import torch

import kvlab
import kvlab.llm
from kvlab.llm import LLM, one_torch_thread
from tiny import build_tiny


def test_one_torch_thread_gives_the_count_back():
    before = torch.get_num_threads()
    with one_torch_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_load_runs_on_one_thread(tmp_path, monkeypatch):
    seen = []
    real = kvlab.llm.load_model
    monkeypatch.setattr(kvlab.llm, "load_model", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(build_tiny("llama", tmp_path)))
        assert seen == [1]
        assert torch.get_num_threads() == 2 and llm.policy.threads in (1, 2)  # 1: another program held a core
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], kvlab.SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        torch.set_num_threads(before)
