"""LLM: the offline Python API, shaped like vLLM's.

    from kvlab import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    print(out.text, out.ttft_s, out.decode_tok_s)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import torch

from kvlab.engine import Engine, Session
from kvlab.errors import KvlabError
from kvlab.model.loader import load_model
from kvlab.output.result import RequestOutput
from kvlab.sampling import SamplingParams

# a prompt is text, or {"prompt_token_ids": [...]} (vLLM's TokensPrompt) for models without a tokenizer
Prompt = Union[str, dict]


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_model_len: int | None = None,
        use_cache: bool = True,
        threads: int | None = None,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.loaded = load_model(model, dtype=dtype, device=device, max_positions=max_model_len)
        self.config = self.loaded.config
        self.tokenizer = _load_tokenizer(self.loaded.path)
        self.engine = Engine(self.loaded, max_model_len=max_model_len, use_cache=use_cache)
        eos = set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.engine.eos_token_ids = tuple(sorted(eos))

    # ---- prompts ---------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if not isinstance(prompt, str):
            raise KvlabError("a prompt is a string or {'prompt_token_ids': [...]}")
        return self._require_tokenizer().encode(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        tokenizer = self._require_tokenizer()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise KvlabError(f"{self.loaded.path} has no tokenizer: pass {{'prompt_token_ids': [...]}} instead")
        return self.tokenizer

    # ---- generation ------------------------------------------------------------------------

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> RequestOutput | list[RequestOutput]:
        """One prompt gives one output; a list gives a list, in the same order."""
        params = params or SamplingParams()
        if isinstance(prompts, list):
            return [self.stream(p, params).finish() for p in prompts]
        return self.stream(prompts, params).finish()

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, session: Session | None = None):
        """A TextStream: iterate it for text pieces; `.output` holds the result once it ends."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        return TextStream(self, text, self.encode(prompt), params, session)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        return self.chat_stream(messages, params).finish()

    def chat_stream(self, messages, params: SamplingParams | None = None, session: Session | None = None):
        """Like `stream`, with the model's chat template applied; a session reuses the cached turns."""
        return TextStream(self, None, self.encode_chat(messages), params or SamplingParams(), session)

    def new_session(self) -> Session:
        return self.engine.new_session()


class TextStream:
    """Runs one request, yielding text as it becomes final (whole UTF-8 characters, stop strings held back)."""

    def __init__(self, llm: LLM, prompt: str | None, prompt_ids: list[int], params: SamplingParams, session):
        self.llm, self.params, self.session = llm, params, session
        self.output = RequestOutput(prompt=prompt, prompt_token_ids=prompt_ids)
        llm.engine.check_prompt(prompt_ids)  # fail before anything streams

    def finish(self) -> RequestOutput:
        for _ in self:
            pass
        return self.output

    def __iter__(self) -> Iterator[str]:
        from kvlab.output.detokenizer import IncrementalDetokenizer
        from kvlab.output.stop import StopStringMatcher

        out, params, engine = self.output, self.params, self.llm.engine
        tokenizer = self.llm.tokenizer
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True) if tokenizer else None
        stop = StopStringMatcher(list(params.stop))
        tokens = engine.generate(out.prompt_token_ids, params, out.metrics, self.session)
        out.finish_reason = "length"
        try:
            for token in tokens:
                out.token_ids.append(token)
                if token in engine.eos_token_ids and not params.ignore_eos:
                    out.finish_reason = "stop"
                    break
                if detok is None:
                    continue
                piece, hit = stop.push(detok.push(token))
                if piece:
                    out.text += piece
                    yield piece
                if hit:
                    out.finish_reason = "stop"
                    return
        finally:
            tokens.close()
        if detok is not None:
            piece, hit = stop.push(detok.flush())
            piece += "" if hit else stop.flush()
            if hit:
                out.finish_reason = "stop"
            if piece:
                out.text += piece
                yield piece


def _load_tokenizer(path: Path):
    """The model's tokenizer, or None for a directory without one (tiny test models)."""
    from kvlab.tokenizer import Tokenizer

    if path.is_dir() and not (path / "tokenizer.json").is_file():
        return None
    return Tokenizer.load(path)
