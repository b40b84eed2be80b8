"""`kvlab lab needle`: the scorer on scripted answers, the prompts (needle at its depth, filler shared
up to it, the chat template around), a run whose answers are scripted by depth, and the verdict."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.lab import needle


@pytest.mark.parametrize("answer, right", [
    ("472913", True),
    ("The secret number of the blue lighthouse is 472913.", True),
    ("472,913", True),
    ("472 913", True),
    ("**472913**", True),
    ("It is 4729130.", False),  # a longer number that contains it
    ("1472913", False),
    ("47291", False),
    ("472 91 3", False),
    ("The number is 815064.", False),  # another fact's number
    ("I don't know.", False),
    ("", False),
])  # fmt: skip
def test_scorer_on_scripted_answers(answer, right):
    assert needle.is_correct(answer, "472913") is right


@pytest.fixture(scope="module")
def builder(tiny_chat_model):
    from kvlab.model.loader import load_model
    from kvlab.tokenizer import load_tokenizer

    pieces, what = needle.filler_text()
    assert "language reference" in what and len(pieces) > 1000
    return needle.PromptBuilder(load_tokenizer(load_model(tiny_chat_model)), pieces)


def test_prompts_put_the_needle_at_its_depth_and_share_the_filler_before_it(builder):
    tok = builder.tok
    assert builder.chat  # the tiny model's ChatML template wraps the whole context in one user turn
    prompts = {d: builder.prompt(400, d, fact=1) for d in (0, 10, 50, 90, 100)}
    positions = [at for _, at in prompts.values()]
    assert positions == sorted(positions) and positions[0] == len(builder.head)
    for depth, (ids, at) in prompts.items():
        assert abs(len(ids) - 400) <= 4, (depth, len(ids))
        assert ids[at : at + len(builder.needle(1))] == builder.needle(1)
        fixed = len(builder.head) + len(builder.tail) + len(builder.needle(1)) + len(builder.question(1)) + 2
        filler = len(ids) - fixed
        assert abs((at - len(builder.head)) - depth / 100 * filler) <= 45  # at the nearest sentence boundary
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert "secret number of the copper kettle is 815064" in text and text.count("815064") == 1
    deep, shallow = prompts[100][0], prompts[50][0]
    assert deep[: prompts[50][1]] == shallow[: prompts[50][1]]  # the prefix the cache reuses
    longer = builder.prompt(800, 100, fact=1)[0]
    assert longer[: prompts[100][1]] == deep[: prompts[100][1]]  # across lengths too
    assert builder.prompt(400, 50, fact=1) == prompts[50]  # deterministic


def test_run_scores_scripted_answers_by_depth(tiny_chat_model, tmp_path, monkeypatch):
    """The engine's answers replaced by a script that finds the needle only ahead of all the filler
    (depth 0): the table must say so, cell by cell."""
    from kvlab.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny_chat_model)
    seen = []

    def scripted(engine, prompts):
        out = []
        for ids in prompts:
            text = tok.decode(ids)
            number = next(n for _, n in needle.FACTS if n in text)
            seen.append(len(ids))
            right = text.index(number) < text.index('"assert" statement')  # before the filler's first words
            out.append(tok.encode(f"It is {number}." if right else "I cannot say.", add_special_tokens=False))
        return out

    monkeypatch.setattr(needle, "answer", scripted)
    assert main(["lab", "needle", "--model", str(tiny_chat_model), "--out", str(tmp_path), "--quick", "--threads", "1",
                 "--no-progress"]) == 0  # fmt: skip
    data = json.loads((tmp_path / "results.json").read_text())["experiments"]["needle"]
    assert data["lengths"] == [256] and data["depths"] == [0, 50, 100] and data["facts_per_cell"] == 2
    assert any("1,000 tokens skipped" in n for n in data["notes"])  # beyond the tiny model's 512 positions
    acc = {c["depth"]: [a["correct"] for a in c["answers"]] for c in data["cells"]}
    assert acc == {0: [True, True], 50: [False, False], 100: [False, False]}
    assert len(seen) == 6 and all(abs(n - 256) <= 4 for n in seen)
    assert "| 0% | 2/2 |" in needle.table(data) and "| 100% | 0/2 |" in needle.table(data)
    report = (tmp_path / "report.md").read_text()
    assert "(needle.png)" in report and "Not judged (quick run)" in report


def cells(pattern: dict[int, list[int]], depths=(0, 10, 50, 90, 100), facts=2) -> dict:
    """Results with `pattern[length][i]` right answers at depths[i]."""
    cells = [{"length": n, "depth": d, "prompt_tokens": n, "needle_at": 0,
              "answers": [{"fact": f, "text": "x", "correct": f < right} for f in range(facts)]}
             for n, row in pattern.items() for d, right in zip(depths, row)]  # fmt: skip
    return {"lengths": list(pattern), "depths": list(depths), "facts_per_cell": facts, "chat_template": True,
            "filler": "f", "trained": 8192, "cells": cells, "seconds_by_length": {}, "notes": []}  # fmt: skip


def test_verdict_judges_depth_and_length_from_the_grid():
    lost = needle.verdict(cells({1000: [2, 2, 2, 2, 2], 8000: [2, 2, 0, 2, 2]}))
    assert lost.startswith("Held:") and "100% of the needles in 1,000 tokens and 80% in 8,000" in lost
    assert "found 0% in the middle (20–80% deep) against 100% near the ends, worst at 50% deep (0%)" in lost
    assert needle.verdict(cells({1000: [2, 2, 2, 2, 2], 8000: [2, 2, 2, 2, 2]})).startswith("Did not hold:")
    assert needle.verdict(cells({1000: [2, 2, 2, 2, 2], 8000: [2, 2, 2, 2, 1]})).startswith("Partly held:")
    assert needle.verdict(cells({1000: [0, 0, 0, 0, 0], 8000: [0, 0, 0, 0, 0]})).startswith("Not judged:")
    one = needle.verdict(cells({1000: [2, 2, 1, 2, 2]}))
    assert one.startswith("Held: only 1,000 tokens were measured (it advertises 8,192): the model found 90%")
    assert "found 50% in the middle (20–80% deep) against 100% near the ends, worst at 50% deep (50%)" in one
    table = needle.table(cells({1000: [2, 2, 2, 2, 2], 8000: [2, 2, 0, 2, 2]}))
    assert "| 50% | 2/2 | 0/2 |" in table and "| **all depths** | 100% | 80% |" in table
