"""Shared fixtures: real models (pulled once into KVLAB_HOME) and tiny random models."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def real_model():
    """Return a function name -> path of the assembled .gguf, pulling it on first use."""
    from kvlab import hub

    def get(name: str):
        return hub.pull(name, quiet=True)

    return get


@pytest.fixture(scope="session")
def transformers_reference():
    """Return a function path of a real .gguf → transformers' own model of it (float32, eval), the oracle.

    transformers reads a GGUF by dequantizing every tensor in NumPy (40-75 s for these models). The
    model it builds is kept once — its config and its weights as safetensors, keyed by the file and
    transformers' version — and later runs build the same model from them (seconds). Nothing of kvlab's
    is involved either way."""
    import shutil

    import safetensors.torch
    import torch
    import transformers

    from kvlab.hub import kvlab_home

    def load(path):
        stat = path.stat()
        saved = kvlab_home() / "test-oracle" / f"{path.stem}-{stat.st_size}-transformers-{transformers.__version__}"
        if (saved / "model.safetensors").exists():
            config = transformers.AutoConfig.from_pretrained(str(saved))
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            safetensors.torch.load_model(model, str(saved / "model.safetensors"))
            return model.eval()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()  # fmt: skip
        partial = saved.with_name(saved.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        model.config.to_json_file(str(partial / "config.json"))
        safetensors.torch.save_model(model, str(partial / "model.safetensors"))
        shutil.rmtree(saved, ignore_errors=True)
        partial.rename(saved)  # whole or not at all
        return model

    return load


def pytest_configure(config):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py is importable as `tiny`
    import os

    os.environ["KVLAB_GC_FREEZE"] = "0"  # this process loads many models: see kvlab.llm.settle_heap


def pytest_sessionstart(session):
    """With KVLAB_KERNELS=require (`make test`, CI) a kernel build failure ends the run in one line, before
    any test: the kernels' tests must fail, not skip, when the compiler is broken."""
    import os

    if os.environ.get("KVLAB_KERNELS") != "require":
        return
    from kvlab.kernels import gemv

    try:
        gemv._ensure_loaded()
    except gemv.KernelBuildError as e:
        pytest.exit(f"kvlab: {e}", returncode=1)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random llama with a trained byte-level BPE tokenizer and a ChatML template."""
    from tiny import add_tiny_tokenizer, build_tiny

    directory = tmp_path_factory.mktemp("tiny-chat")
    build_tiny("llama", directory)
    return add_tiny_tokenizer(directory)


@pytest.fixture(scope="session")
def tiny_llm(tiny_chat_model):
    from kvlab import LLM

    return LLM(tiny_chat_model)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine spinning threads cost 10×+."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cpu_ops():
    """The CPU's ops in force (kvlab/backends/ops.py), as a driver puts them around a pass: for tests that run
    one module by hand and mean the C kernels (outside a driver a module runs PyTorch's own code)."""
    from kvlab.backends.ops import ops_for

    with ops_for("cpu").active() as ops:
        yield ops
