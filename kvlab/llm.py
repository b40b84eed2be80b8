"""LLM: the offline Python API, shaped like vLLM's, over the serving engine.

    from kvlab import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(max_tokens=16, temperature=0))
    print(outs[0].text, outs[0].ttft_s, outs[0].decode_tok_s, outs[0].metrics.timing_split())

A list of prompts runs as one continuous batch (`kvlab.engine.LLMEngine`); outputs come back in
input order, each with its own timings. `stream()` yields text as it is decoded; chat turns reuse
the previous turns' K/V through the prefix cache.

Tensor parallelism (vLLM's name, and its external-launcher way): launched by torchrun, every rank runs
the same script, `LLM(model, tensor_parallel_size=N)` joins the job and holds its shard of the weights
and of the KV cache, and every rank's `generate` runs the same schedule and returns the same outputs.

    torchrun --nproc-per-node 2 script.py      # script.py: LLM("qwen2.5-coder-0.5b", tensor_parallel_size=2)
"""

from __future__ import annotations

import atexit
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy, cpu_load
from kvlab.model.huge_pages import into_huge_pages
from kvlab.model.loader import load_model
from kvlab.quant.activations import check_activation_quant, with_activation_setting
from kvlab.output.result import RequestOutput
from kvlab.parallel.group import TPGroup
from kvlab.sampling import SamplingParams
from kvlab.tokenizer import load_tokenizer

# a prompt is text, or {"prompt_token_ids": [...]} (vLLM's TokensPrompt) for models without a tokenizer
Prompt = Union[str, dict]


@dataclass
class ChatSession:
    """A conversation. Its earlier turns' K/V stay in the prefix cache (by their tokens), so a new turn
    prefills only what follows the longest cached start; the session itself pins nothing."""

    turns: int = 0


Session = ChatSession  # the name the single-sequence engine used


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        use_cache: bool = True,
        threads: int | None = None,
        dequantize: bool = False,
        quantization: str | None = None,
        activation_quant: str | None = None,
        tensor_parallel_size: int = 1,
        rope_scaling: str | dict | None = None,
        **engine_options: Any,
    ):
        """`threads`: CPU threads of this LLM's passes (its own thread policy; default: torch's count, fewer
        when other programs keep cores busy, see kernels/cpu_load.py; `cpu_load` says what was measured).
        `dequantize`: expand a GGUF file's blocks to `dtype` floats at load (default: compute with them
        as stored). `quantization`: "q8_0" or "q4_0" blocks made from a float checkpoint at load.
        `activation_quant`: "int8" rounds activations to 8 bits in every product over blocks
        (kvlab/quant/activations.py: faster, not exact; default None, exact); "bf16x3" keeps them exact
        as three bfloat16 parts on AMX tiles (faster for many sequences at once).
        `engine_options` are EngineConfig fields: block_size, kv_memory_bytes, kv_memory_fraction,
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, pack_prompts, prompt_cache_dir and
        prompt_cache_size (the prefix cache's blocks kept on disk too, kv/prompt_cache.py).
        `tensor_parallel_size`: the ranks of the torchrun job this process belongs to (kvlab/parallel;
        a KvlabError outside torchrun or when WORLD_SIZE differs); 1: a model of its own in this process.
        `rope_scaling`: a config.json rope_scaling block (dict or JSON) in place of the model's own, e.g.
        {"rope_type": "yarn", "factor": 2.0}: the context may then run to original × factor tokens
        (`config.max_position_embeddings` stays the trained length; see `with_rope_scaling`)."""
        if threads is not None and threads < 1:
            raise KvlabError(f"threads must be at least 1, got {threads}")
        self.group = TPGroup.single()
        if tensor_parallel_size != 1:  # joins the job: every rank gets here, with the same arguments
            from kvlab.parallel import launch_rank, tensor_parallel

            launch_rank(tensor_parallel_size, api=True)  # a launch that does not match: say how to launch
            self.group = tensor_parallel(tensor_parallel_size, device)
            atexit.register(self.group.close)  # rank 0's shared-memory segment, if close() is never called
            device = self.group.device  # cuda: the rank's own device (LOCAL_RANK)
        if rope_scaling is not None:  # a bad block is refused before the weights load
            from kvlab.config.rope import parse_rope_scaling

            rope_scaling = parse_rope_scaling(rope_scaling, "rope_scaling")
        before_load = cpu_load.snapshot() if torch.device(device).type == "cpu" else None
        self.loaded = load_model(model, dtype=dtype, device=device, max_positions=max_model_len,
                                 dequantize=dequantize, quantization=quantization,
                                 huge_pages=False)  # below: after a shard is cut and a setting repacks  # fmt: skip
        if rope_scaling is not None:
            self.loaded = with_rope_scaling(self.loaded, rope_scaling, max_model_len)
        # other programs' load on our CPUs while the model loaded: fewer threads when they hold a core
        self.cpu_load = cpu_load.measure(before_load)
        if self.group.world_size > 1:
            from kvlab.parallel import shard_model

            self.loaded = shard_model(self.loaded, self.group)  # this rank's shard of every layer
        if activation_quant is not None:
            check_activation_quant(activation_quant)
            # after sharding: each rank repacks its own rows
            self.loaded = with_activation_setting(self.loaded, activation_quant)
        moving = time.perf_counter()
        into_huge_pages(self.loaded.model)  # what a decode step streams, in its final form (model/huge_pages.py)
        self.loaded.load_s += time.perf_counter() - moving  # part of the load, as in load_model
        default = torch.get_num_threads()
        self.policy = ThreadPolicy(threads=threads or (self.cpu_load.threads_for(default) if self.cpu_load else default))
        self.config = self.loaded.config
        self.tokenizer = load_tokenizer(self.loaded)
        try:
            engine_config = EngineConfig(max_model_len=max_model_len, use_cache=use_cache, **engine_options)
        except TypeError as e:
            raise KvlabError(f"unknown engine option: {e}") from None
        if self.group.world_size > 1:
            from kvlab.parallel import agree_engine_config

            engine_config = agree_engine_config(engine_config, self.loaded, self.group)
        self.engine = LLMEngine(self.loaded, self.tokenizer, engine_config, policy=self.policy)
        # the loader's parse of a GGUF file (its metadata: the vocabulary and merges as Python objects) has had
        # its readers, the tokenizer and an MTP head: not kept resident while the model serves (SmolLM2 10-14
        # MB, Qwen2.5-Coder-0.5B's 151,936 tokens 27 MB); a later reader opens the file again
        self.loaded.gguf = None
        if torch.device(device).type == "cpu":
            release_openmp_threads()  # the engine's first pass, in whichever thread, makes the only team
            warn_if_openmp_spins()
        self._streams: dict[str, TextStream] = {}

    def close(self) -> None:
        """Leave the tensor-parallel job (its process group, the shared-memory segment); write the prompt
        cache's queued blocks (--prompt-cache-dir) and stop its threads."""
        self.engine.close()
        self.group.close()

    # ---- prompts ---------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if not isinstance(prompt, str):
            raise KvlabError("a prompt is a string or {'prompt_token_ids': [...]}")
        return self._require_tokenizer().encode(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The conversation through the model's chat template (`tools`: OpenAI-shaped tool definitions,
        for templates with a tools section)."""
        # the template writes any BOS itself; special tokens in message content stay text
        extra = {"tools": tools} if tools else {}
        return self._require_tokenizer().encode_chat(messages, add_generation_prompt=True, **extra)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise KvlabError(f"{self.loaded.path} has no tokenizer: pass {{'prompt_token_ids': [...]}} instead")
        return self.tokenizer

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> RequestOutput | list[RequestOutput]:
        """One prompt gives one output; a list runs as one batch and gives a list, in the same order."""
        params = params or SamplingParams()
        single = not isinstance(prompts, list)
        streams = [self.stream(p, params) for p in ([prompts] if single else prompts)]  # every prompt checked first
        for s in streams:
            s.start()
        for s in streams:
            s.finish()
        return streams[0].output if single else [s.output for s in streams]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, session: ChatSession | None = None):
        """A TextStream: iterate it for text pieces; `.output` holds the result once it ends."""
        text = prompt if isinstance(prompt, str) else None
        return TextStream(self, text, self.encode(prompt), params or SamplingParams(), session)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        return self.chat_stream(messages, params).finish()

    def chat_stream(self, messages, params: SamplingParams | None = None, session: ChatSession | None = None):
        """Like `stream`, with the model's chat template applied; earlier turns come from the prefix cache."""
        return TextStream(self, None, self.encode_chat(messages), params or SamplingParams(), session)

    def new_session(self) -> ChatSession:
        return ChatSession()

    # ---- driving the engine ------------------------------------------------------------------

    def _step(self) -> None:
        """One engine step; hand each stream its new text."""
        if not self.engine.has_unfinished_requests:
            raise RuntimeError("a stream is waiting but the engine has no request left")
        for out in self.engine.step():
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_text and out.index == 0:  # a stream shows the first choice; `.output` holds them all
                stream.pieces.append(out.new_text)
            if out.finished:
                stream.done = True
                del self._streams[out.request_id]


def with_rope_scaling(loaded, scaling: str | dict, max_positions: int | None = None):
    """`loaded` with the rope_scaling block `scaling` in place of the model's own (ModelConfig.with_rope_scaling):
    its rotary tables rebuilt for `max_positions` (default: the stretched context). The same weights: the
    model object is changed in place, and the LoadedModel returned carries the new config."""
    import dataclasses

    config = loaded.config.with_rope_scaling(scaling)
    loaded.model.config = config
    loaded.model.build_rotary(max_positions or config.context_limit, loaded.model.device)
    return dataclasses.replace(loaded, config=config)


class TextStream:
    """One request, yielding text as it becomes final (whole UTF-8 characters, stop strings held back).

    Iterating drives the engine, which advances every request it holds (other streams, a batch).
    Closing the iterator early aborts the request and frees its blocks.
    """

    def __init__(self, llm: LLM, prompt: str | None, prompt_ids: list[int], params: SamplingParams, session=None):
        self.llm, self.params, self.session = llm, params, session
        self.output = RequestOutput(prompt=prompt, prompt_token_ids=prompt_ids)
        llm.engine.check_prompt(prompt_ids)  # fail before anything streams
        self.request_id: str | None = None
        self.pieces: deque[str] = deque()
        self.done = False

    def start(self) -> None:
        """Queue the request in the engine (iterating does it too)."""
        if self.request_id is None:
            self.request_id = self.llm.engine.add_request(self.output.prompt_token_ids, self.params, output=self.output)
            self.llm._streams[self.request_id] = self
            if self.session is not None:
                self.session.turns += 1

    def finish(self) -> RequestOutput:
        for _ in self:
            pass
        return self.output

    def __iter__(self) -> Iterator[str]:
        self.start()
        try:
            while True:
                while self.pieces:
                    yield self.pieces.popleft()
                if self.done:
                    return
                self.llm._step()
        finally:
            if not self.done:  # closed early (a stop string the caller handles, a closed pipe)
                self.llm.engine.abort_request(self.request_id)
                self.llm._streams.pop(self.request_id, None)
                self.done = True




def warn_if_openmp_spins() -> None:
    """One warning where PyTorch loaded its OpenMP before kvlab could set GOMP_SPINCOUNT (kvlab/__init__.py):
    its threads then spin 30 times longer between operations, on the cores kvlab's pool computes on. A
    SmolLM2 pass of 8 × 64 prompt tokens on 2 cores: 140 → 186 ms with int8 activations, 447 → 488 exact."""
    import warnings

    import kvlab

    if kvlab.OPENMP_SPIN_TOO_LATE and sys.platform.startswith("linux"):
        warnings.warn("PyTorch was imported before kvlab, so its OpenMP threads spin 300,000 turns between "
                      "operations on the cores kvlab's kernels use (prompt passes 10-33% slower here): import "
                      "kvlab first, or set GOMP_SPINCOUNT=10000 before Python starts", RuntimeWarning,
                      stacklevel=3)  # fmt: skip


def release_openmp_threads() -> bool:
    """Let the OpenMP runtime free this thread's team of workers (`omp_pause_resource_all`, hard).

    libgomp gives every thread that starts a parallel region a team of its own, and once it manages
    more threads than there are cores it spins only 100 turns before a worker sleeps, whatever
    GOMP_SPINCOUNT says. A model loaded on the main thread (PyTorch's ops made a team there) and stepped
    by another (kvlab serve's engine thread) therefore woke a futex per operation: 32 SmolLM2 prompts of
    256 tokens stepped in a thread took 7.7 s of prefill with 40,000 voluntary context switches, 6.4 s
    and 3,000 once the loading thread's team was freed (its next parallel region, if any, makes a new
    one). Every OpenMP runtime loaded is asked (another package may bring its own copy). False where
    none with the call is loaded, or none could pause."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return False
    paused = False
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        paused = pause(2) == 0 or paused  # omp_pause_hard
    return paused


def settle_heap() -> bool:
    """Settle the heap of a process that holds one model until it exits (`kvlab run`, `chat`, `serve`, the
    benchmarks' workers), after the load:

    - every object alive now (the model's modules, the tokenizer's tables, the engine) goes out of the
      cyclic garbage collector's reach (`gc.freeze`, as vLLM's servers do), so that a full collection no
      longer walks them: ~3% of SmolLM2's decode time, measured;
    - glibc's malloc keeps the memory of freed buffers for the next ones (`keep_freed_memory`).

    A cycle among the frozen objects that dies later is never collected, hence not in `LLM()` itself (a
    test process loads hundreds of models: its conftest sets KVLAB_GC_FREEZE=0, which turns both off).
    False where it was off."""
    import gc
    import os

    if os.environ.get("KVLAB_GC_FREEZE", "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    keep_freed_memory()
    return True


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_FREED = 256 << 20  # bytes of free memory glibc keeps at the heap's top before it gives them back
MMAP_FROM = 32 << 20  # the size from which a buffer is mapped on its own (glibc's largest threshold)


def keep_freed_memory() -> bool:
    """glibc's malloc maps each buffer past its threshold on its own and unmaps it when freed, and gives
    the free top of its heap back past another: a prompt pass allocates and frees the same tens of
    megabytes of activations in every layer, and each time the kernel zeroes and faults in their pages
    anew (perf over 16 SmolLM2 prompts of 64 tokens, int8 products: page faults ~5% of the time). Raising
    both thresholds keeps those pages: the burst's prefill took 612 instead of 770 ms (medians of 6,
    interleaved runs). A process's peak is unchanged (the pages were in use at the peak); what it holds
    after a peak stays up to KEEP_FREED higher. False where the C library has no mallopt (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_FROM)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED))
