"""Where the lab's claims come from: the two documents its experiments reproduce, named in plain words.

Each experiment module names its SOURCE; the report says, beside every claim, which document made it
and what that document measured (the module's MEASURED), and each verdict compares with that figure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    title: str  # the document, as the report names it beside a claim
    short: str  # in a verdict's comparison: "(the course measured 12× at 512)"


COURSE = Source(
    "the course “Inference, KV cache and context” (module 04 of an LLM curriculum), which measured "
    "Qwen3-0.6B in float32 with PyTorch on 8 CPU cores",
    "the course",
)
BLOG_POST = Source(
    "the blog post “Prefill and decode: the KV cache and the memory wall”, which measured Qwen2.5-0.5B "
    "with PyTorch on a CPU",
    "the post",
)
SPEC_ARTICLE = Source(
    "the article “I Benchmarked Speculative Decoding — α = 3.5 Wasn't Enough” (dev.to), which measured "
    "Qwen2.5-0.5B-Instruct drafting for Qwen2.5-1.5B-Instruct on a 12th-gen Intel CPU",
    "the article",
)
