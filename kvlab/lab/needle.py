"""Experiment `needle`: a fact hidden at every depth of contexts of several lengths, asked back at the end.

For each context length (prompt tokens, template included) and depth 0%, 10%, …, 100%, each of
FACTS_PER_CELL facts in turn is written into fixed filler text at that depth, and the question about it
follows the filler, all in one user turn of the model's chat template (a plain "Question: … Answer:"
where it has none). The answer is decoded greedily; it is right when it holds the fact's number.

    [template head] filler[:p] "The secret number of <subject> is <number>." filler[p:] question [template tail]

The filler is English prose every Python install carries (the language reference's topics, the text of
`pydoc`'s help); the needle goes in between the two sentences nearest the depth. Everything is fixed
(filler, facts, greedy decoding): a rerun gives the same table.

Prompts run one after another through the serving engine with prefix caching, longest context and
deepest needle first: every prompt shares the filler up to its needle with one run before it, so only
the needle, the filler after it and the question are prefilled again.
"""

from __future__ import annotations

import re
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlab.errors import KvlabError
from kvlab.lab.common import Lab
from kvlab.lab.report import held, md_table, num, pct
from kvlab.lab.sources import COURSE

NAME = "needle"
TITLE = "A fact buried in a long context: found at every depth?"
CLAIM = (
    "Models get worse at using information placed deep inside a long context (\"lost in the middle\"): "
    "the context length a model advertises is not the context it can use."
)
SOURCE = COURSE
MEASURED = "nothing: it cites Liu et al., 2023 (“lost in the middle”)"

LENGTHS, QUICK_LENGTHS = (1000, 4000, 8000), (256, 1000)
DEPTHS, QUICK_DEPTHS = tuple(range(0, 101, 10)), (0, 50, 100)  # percent of the filler before the needle
FACTS_PER_CELL, QUICK_FACTS_PER_CELL = 3, 2
ANSWER_TOKENS = 16  # greedy tokens decoded per answer (a number and a few words around it)
EDGE_DEPTHS = (0, 10, 90, 100)  # the verdict's "edges"; 20-80% is "the middle"
DROP = 0.15  # an accuracy drop the verdict counts

# (subject, number): fixed, one per prompt of a cell; the number is nowhere in the filler
FACTS = (
    ("the blue lighthouse", "472913"), ("the copper kettle", "815064"), ("the northern orchard", "390527"),
    ("the quiet library", "628351"), ("the paper kite", "957240"), ("the old ferry", "164839"),
)  # fmt: skip
NEEDLE = "The secret number of {subject} is {number}."
QUESTION = "What is the secret number of {subject}? Reply with the number only."


@dataclass
class Answer:
    fact: int  # index into FACTS
    text: str
    correct: bool


@dataclass
class Cell:
    length: int  # prompt tokens asked for (the prompts of the cell are within a few tokens of it)
    depth: int  # percent
    prompt_tokens: int  # of the cell's first prompt
    needle_at: int  # token position of the needle's first token (in the cell's first prompt)
    answers: list[Answer]

    @property
    def accuracy(self) -> float:
        return sum(a.correct for a in self.answers) / len(self.answers)


@dataclass
class NeedleResult:
    lengths: list[int]
    depths: list[int]
    facts_per_cell: int
    chat_template: bool
    filler: str
    trained: int | None  # the model's max_position_embeddings
    cells: list[Cell] = field(default_factory=list)
    seconds_by_length: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ---- scoring ------------------------------------------------------------------------------------


def is_correct(answer: str, number: str) -> bool:
    """The answer holds `number` whole (not inside a longer run of digits; digit-group commas or spaces,
    "472,913", are read through)."""
    digits = re.sub(r"(?<=\d)[,\u202f\u00a0 ](?=\d{3}\b)", "", answer)
    return re.search(rf"(?<!\d){re.escape(number)}(?!\d)", digits) is not None


# ---- the prompts ----------------------------------------------------------------------------------


def filler_text() -> tuple[list[str], str]:
    """(pieces, description): the Python language reference topics (pydoc_data/topics.py), in the order
    of their names, cut into sentences (a paragraph's last one keeps its blank line): a needle goes in
    between two of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise KvlabError(f"no pydoc_data under {root}: the needle's filler text is Python's own help text") from None
    pieces = []
    for name in sorted(topics):
        for paragraph in filter(None, (p.strip() for p in topics[name].split("\n\n"))):
            sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)
            pieces += [s + " " for s in sentences[:-1]] + [sentences[-1] + "\n\n"]
    return pieces, f"Python {sysconfig.get_python_version()} language reference (pydoc_data/topics.py)"


class PromptBuilder:
    """Token ids of needle prompts: template head, filler with the needle between two sentences,
    question, template tail. Filler sentences are tokenized once, so every prompt shares the same
    filler ids up to its needle (what the prefix cache reuses)."""

    def __init__(self, tokenizer, pieces: list[str]):
        self.tok = tokenizer
        self.chat = bool(tokenizer.chat_template)
        mark = "\x00CONTEXT\x00"
        if self.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True)
            head, tail = text.split(mark)
            self.head, self.tail = self._encode(head), self._encode(tail)
        else:
            bos = tokenizer.encode("", add_special_tokens=True)
            self.head, self.tail = bos, self._encode("\nAnswer:")
        self.pieces = [self._encode(p) for p in pieces]

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def question(self, fact: int) -> list[int]:
        return self._encode("Question: " + QUESTION.format(subject=FACTS[fact][0]))

    def needle(self, fact: int) -> list[int]:
        subject, number = FACTS[fact]
        return self._encode(NEEDLE.format(subject=subject, number=number) + " ")

    def filler(self, num_tokens: int) -> tuple[list[int], list[int]]:
        """(filler ids of `num_tokens` tokens, the offsets where its sentences start, 0 and the end included)."""
        ids, starts = [], [0]
        for piece in self._cycle():
            take = piece[: num_tokens - len(ids)]
            ids += take
            starts.append(len(ids))
            if len(ids) >= num_tokens:
                return ids, starts

    def _cycle(self):
        while True:
            yield from self.pieces

    def prompt(self, length: int, depth: int, fact: int) -> tuple[list[int], int]:
        """(ids of about `length` tokens with the needle of `fact` at `depth` percent, the needle's position)."""
        fixed = len(self.head) + len(self.tail) + len(self.needle(fact)) + len(self.question(fact)) + 2
        if length <= fixed + 16:
            raise KvlabError(f"a needle prompt of {length} tokens leaves no room for filler")
        filler, starts = self.filler(length - fixed)
        cut = min(starts, key=lambda s: (abs(s - depth / 100 * len(filler)), s))  # the nearest; the earlier on a tie
        context = filler[:cut] + self.needle(fact) + filler[cut:] + self._encode("\n\n") + self.question(fact)
        ids = self.head + context + self.tail
        return ids, len(self.head) + cut


# ---- the run ----------------------------------------------------------------------------------------


def _engine(lab: Lab, tokenizer, max_len: int):
    from kvlab.config import EngineConfig
    from kvlab.engine import LLMEngine
    from kvlab.kernels import ThreadPolicy
    from kvlab.kv.paged import PagedKVCache

    per_token = PagedKVCache.bytes_per_token_for(lab.config, lab.model.dtype)
    # room for the longest prompt's filler (kept for the prompts after it) and the prompt being answered
    config = EngineConfig(max_model_len=max_len, kv_memory_bytes=per_token * (3 * max_len + 256), max_num_seqs=8,
                          max_num_batched_tokens=1024, enable_prefix_caching=True)  # fmt: skip
    return LLMEngine(lab.loaded, tokenizer, config, policy=ThreadPolicy(threads=torch.get_num_threads()))


def answer(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers to `prompts`, decoded together, in order."""
    from kvlab.sampling import SamplingParams

    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.output.token_ids)
    return [done[i] for i in ids]


@torch.inference_mode()
def run(lab: Lab) -> NeedleResult:
    from kvlab.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(lab.loaded)
    if tokenizer is None:
        raise KvlabError(f"{lab.model_name} has no tokenizer: the needle experiment asks questions in text")
    lengths, notes = lab.sizes(LENGTHS, QUICK_LENGTHS, room=ANSWER_TOKENS + 8)
    depths = list(QUICK_DEPTHS if lab.quick else DEPTHS)
    facts = QUICK_FACTS_PER_CELL if lab.quick else FACTS_PER_CELL
    pieces, what = filler_text()
    builder = PromptBuilder(tokenizer, pieces)
    result = NeedleResult(lengths, depths, facts, builder.chat, what, lab.config.max_position_embeddings, [], {}, notes)
    if not lengths:
        return result
    engine = _engine(lab, tokenizer, max(lengths) + ANSWER_TOKENS + 8)
    bar = lab.progress(len(lengths) * len(depths), NAME)
    # longest first, deepest first: each prompt's filler up to its needle is a prefix of one already run
    for length in sorted(lengths, reverse=True):
        start = time.perf_counter()
        for depth in sorted(depths, reverse=True):
            bar.set_postfix_str(f"{length:,} tokens, depth {depth}%")
            prompts = [builder.prompt(length, depth, fact) for fact in range(facts)]
            # the first alone, then the rest together: they find its filler in the prefix cache
            outs = answer(engine, [prompts[0][0]]) + answer(engine, [p for p, _ in prompts[1:]])
            answers = []
            for fact, out in enumerate(outs):
                text = tokenizer.decode(out, skip_special_tokens=True).strip()
                answers.append(Answer(fact, text, is_correct(text, FACTS[fact][1])))
            result.cells.append(Cell(length, depth, len(prompts[0][0]), prompts[0][1], answers))
            bar.update(result)
        result.seconds_by_length[str(length)] = time.perf_counter() - start
    bar.close()
    result.cells.sort(key=lambda c: (c.length, c.depth))
    return result


# ---- the report ------------------------------------------------------------------------------------


def grid(data: dict) -> dict[tuple[int, int], float]:
    """(length, depth) → accuracy."""
    return {(c["length"], c["depth"]): sum(a["correct"] for a in c["answers"]) / len(c["answers"])
            for c in data["cells"]}  # fmt: skip


def table(data: dict) -> str:
    acc = grid(data)
    lengths = [n for n in data["lengths"] if any((n, d) in acc for d in data["depths"])]
    if not lengths:
        return "No context length fitted the model (see the notes)."
    head = ["depth", *(f"{num(n)} tokens" for n in lengths)]
    facts = data["facts_per_cell"]
    rows = [[f"{d}%", *(f"{round(acc[n, d] * facts)}/{facts}" if (n, d) in acc else "–" for n in lengths)]
            for d in data["depths"]]  # fmt: skip
    rows.append(["**all depths**", *(pct(mean([acc[n, d] for d in data["depths"] if (n, d) in acc])) for n in lengths)])
    seconds = data.get("seconds_by_length", {})
    rows.append(["seconds", *(num(seconds[str(n)], 0) if str(n) in seconds else "–" for n in lengths)])
    how = "the model's chat template" if data["chat_template"] else "a plain prompt (the model has no chat template)"
    wrong = [a["text"] for c in data["cells"] for a in c["answers"] if not a["correct"]]
    sample = f" A wrong answer, for instance: “{wrong[0][:80]}”." if wrong else ""
    return md_table(head, rows) + (
        f"\n\nRight answers of {facts} facts per cell, greedy, through {how}; filler: {data['filler']}. Seconds: "
        f"each length's prompts, run longest first (a shorter one reuses the cached filler of a longer).{sample}"
    )


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def verdict(data: dict) -> str:
    acc = grid(data)
    lengths = sorted({n for n, _ in acc})
    if not lengths:
        return "Not judged: no context length fitted the model."
    short, long = lengths[0], lengths[-1]
    overall = {n: mean([acc[n, d] for d in data["depths"] if (n, d) in acc]) for n in lengths}
    if overall[short] == 0:
        return (f"Not judged: the model found no needle even in {num(short)} tokens, so depth and length cannot "
                "make it worse.")  # fmt: skip
    edges = mean([acc[long, d] for d in data["depths"] if d in EDGE_DEPTHS and (long, d) in acc])
    middle = mean([acc[long, d] for d in data["depths"] if 20 <= d <= 80 and (long, d) in acc])
    length_drop, middle_drop = overall[short] - overall[long], edges - middle
    worst = min((acc[long, d], d) for d in data["depths"] if (long, d) in acc)
    trained = f" (it advertises {num(data['trained'])})" if data.get("trained") else ""
    if short == long:
        found = f"only {num(long)} tokens were measured{trained}: the model found {pct(overall[long])} of the needles"
    else:
        found = (f"the model found {pct(overall[short])} of the needles in {num(short)} tokens and "
                 f"{pct(overall[long])} in {num(long)}{trained}")  # fmt: skip
    at_worst = f", worst at {worst[1]}% deep ({pct(worst[0])})" if worst[0] < 1 else ""
    return (
        f"{held(length_drop >= DROP or middle_drop >= DROP, length_drop > 0 or middle_drop > 0)}: {found}; at "
        f"{num(long)} tokens it found {pct(middle)} in the middle (20–80% deep) against {pct(edges)} near the "
        f"ends{at_worst}."
    )
