"""Shared fixtures: real models (pulled once into KVLAB_HOME) and tiny random models."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def real_model():
    """Return a function name -> path of the assembled .gguf, pulling it on first use."""
    from kvlab import hub

    def get(name: str):
        return hub.pull(name, quiet=True)

    return get


class Oracle:
    """transformers' own model of a real GGUF (float32, eval) and its tokenizer: the reference the real
    tests compare kvlab with. Nothing of kvlab's is involved.

    transformers reads a GGUF by dequantizing every tensor in NumPy (40-75 s for these models) and
    builds its tokenizer by converting the file's vocabulary (up to half a minute for Gemma's). Both are
    kept once, keyed by the file and transformers' version: the model as its config and safetensors,
    the tokenizer as its own saved files. Its greedy continuation of a prompt (transformers' generate)
    is kept too, keyed by the ids, the length and PyTorch's version, so that a later run computes only
    kvlab's side of each comparison. KVLAB_TEST_ORACLE=fresh recomputes and replaces every kept
    answer."""

    def __init__(self, path):
        import torch
        import transformers

        from kvlab.hub import kvlab_home

        self.path = path
        size = path.stat().st_size
        self.saved = kvlab_home() / "test-oracle" / f"{path.stem}-{size}-transformers-{transformers.__version__}"
        self.torch_version = torch.__version__
        self.fresh = os.environ.get("KVLAB_TEST_ORACLE") == "fresh"
        self._model = self._tokenizer = None

    @property
    def model(self):
        import safetensors.torch
        import torch
        import transformers

        if self._model is not None:
            return self._model
        kept = self.saved / "model"
        if (kept / "model.safetensors").exists() and not self.fresh:
            config = transformers.AutoConfig.from_pretrained(str(kept))
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            safetensors.torch.load_model(model, str(kept / "model.safetensors"))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, dtype=torch.float32)  # fmt: skip
            self._keep("model", lambda d: (model.config.to_json_file(str(d / "config.json")),
                                           safetensors.torch.save_model(model, str(d / "model.safetensors"))))  # fmt: skip
        self._model = model.eval()
        return self._model

    @property
    def tokenizer(self):
        import transformers

        if self._tokenizer is None:
            kept = self.saved / "tokenizer"
            if kept.is_dir() and not self.fresh:
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(kept))
            else:
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.path.parent),
                                                                             gguf_file=self.path.name)  # fmt: skip
                self._keep("tokenizer", lambda d: self._tokenizer.save_pretrained(str(d)))
        return self._tokenizer

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """transformers' n greedy tokens after ids (no end-of-sequence stop), computed once."""
        import hashlib
        import json

        key = hashlib.sha256(json.dumps([self.torch_version, list(ids), n]).encode()).hexdigest()[:32]
        kept = self.saved / "greedy" / f"{key}.json"
        if kept.exists() and not self.fresh:
            return json.loads(kept.read_text())
        from test_real import reference_greedy

        tokens = reference_greedy(self.model, list(ids), n)
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".partial-{os.getpid()}")
        partial.write_text(json.dumps(tokens))
        partial.replace(kept)  # whole or not at all
        return tokens

    def _keep(self, name: str, write) -> None:
        """Write one kept folder (the model, the tokenizer) whole or not at all. Each process writes its own
        partial folder (two test runs on one machine share this cache: a shared name raced, one run's mkdir
        meeting the other's folder), and one left by a process that is gone is removed."""
        import shutil

        target = self.saved / name
        for stale in self.saved.glob(f"{name}.partial-*"):
            pid = stale.name.rsplit("-", 1)[1]
            if not pid.isdigit() or not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write(partial)
        shutil.rmtree(target, ignore_errors=True)
        try:
            partial.rename(target)
        except OSError:  # another run kept it in the meantime: theirs stays
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@pytest.fixture(scope="session")
def transformers_reference():
    """Return a function path of a real .gguf → its Oracle (transformers' model, tokenizer, greedy answers)."""
    return Oracle


def pytest_configure(config):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py is importable as `tiny`
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
