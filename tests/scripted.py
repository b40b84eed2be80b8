"""Scripted answers for server tests: the engine's sampler replaced by a list of token ids, so that a tiny
random model "says" exactly what a test needs (a tool call, a thinking block), token by token, through
everything after sampling (the detokenizer, stop checks, the wire formats' parsers).

    with scripted(server.llm, llm.tokenizer.encode("<think>hm</think>yes", add_special_tokens=False)):
        ...   every request's sequence gets the script's tokens in order, then end-of-sequence
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def scripted(llm, token_ids: list[int]):
    runner = llm.engine.runner
    sample = runner.sample
    eos = llm.tokenizer.eos_token_ids[0]
    positions: dict = {}

    def replay(requests, logits):
        result = sample(requests, logits)
        for key in result.sampled_token_ids:
            at = positions.get(key, 0)
            positions[key] = at + 1
            result.sampled_token_ids[key] = [token_ids[at] if at < len(token_ids) else eos]
        return result

    runner.sample = replay
    try:
        yield
    finally:
        runner.sample = sample
