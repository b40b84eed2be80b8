"""LLM() on a CPU lets the OpenMP runtime free the loading thread's team of workers afterwards
(kvlab.llm.release_openmp_threads), so that the thread that steps the engine (kvlab serve's engine thread)
owns the only team: with two, libgomp manages more threads than cores and barely spins."""

from __future__ import annotations

import glob
import platform

import pytest
import torch

import kvlab
import kvlab.llm
from kvlab.llm import LLM, release_openmp_threads
from tiny import build_tiny


def threads_of_this_process() -> int:
    return len(glob.glob("/proc/self/task/*"))


@pytest.mark.skipif(platform.system() != "Linux", reason="counts threads in /proc")
def test_the_team_of_workers_is_freed_and_comes_back_when_needed():
    if not any("libgomp" in line for line in open("/proc/self/maps")):
        pytest.skip("PyTorch here runs no libgomp")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.arange(1 << 22, dtype=torch.float32)
        total = (x * 2).sum().item()  # a parallel region: the team exists now
        with_team = threads_of_this_process()
        assert release_openmp_threads() is True
        assert threads_of_this_process() < with_team
        assert (x * 2).sum().item() == total  # the next region makes a team again
    finally:
        torch.set_num_threads(before)


def test_an_llm_on_a_cpu_frees_it_after_the_load(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(kvlab.llm, "release_openmp_threads", lambda: calls.append("release") or True)
    llm = LLM(str(build_tiny("llama", tmp_path)))
    assert calls == ["release"]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], kvlab.SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.skipif(platform.system() != "Linux", reason="the spin is libgomp's, read when Linux loads it")
def test_torch_imported_first_is_told_once_how_to_keep_its_openmp_off_the_cores(tiny_chat_model):
    """kvlab sets GOMP_SPINCOUNT at import, which PyTorch's OpenMP reads only when it loads: imported after
    torch, LLM() warns (and says what to do); imported first, or with the variable set, it does not."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    load = f"from kvlab import LLM; LLM({str(tiny_chat_model)!r}, max_model_len=64)"

    def stderr(first: str, extra: dict | None = None) -> str:
        run = subprocess.run([sys.executable, "-c", f"{first}; {load}"], env={**env, **(extra or {})},
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
        return run.stderr

    told = "PyTorch was imported before kvlab"
    assert stderr("import torch, kvlab").count(told) == 1
    assert "GOMP_SPINCOUNT=10000" in stderr("import torch, kvlab")
    assert told not in stderr("import kvlab, torch")
    assert told not in stderr("import torch, kvlab", {"GOMP_SPINCOUNT": "300000"})
