"""Streaming output: the incremental detokenizer and the stop-string matcher."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as FastTokenizer, decoders, models, pre_tokenizers, trainers

from kvlab.output.detokenizer import IncrementalDetokenizer
from kvlab.output.stop import StopStringMatcher
from kvlab.tokenizer import Tokenizer

STREAM_TEXTS = [
    "héllo wörld — naïve café 🙂👍🏽 世界 日本語テキスト ✨ 👨‍👩‍👧‍👦 done",
    "🇫🇷🇯🇵😀😃😄 emoji only at the start",
    "Ünïcödé ends in an emoji 🎉",
]


def stream(tok, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def assert_clean_stream(tok, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    pieces = stream(tok, ids, skip_special_tokens)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    return pieces


@pytest.fixture(scope="module")
def synthetic() -> Tokenizer:
    """A byte-level BPE small enough that every non-ASCII character spans several tokens."""
    backend = FastTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer=trainer)
    return Tokenizer(backend, eos_token_ids=[1])


# ---------------------------------------------------------------------------------------------------------------------
# IncrementalDetokenizer.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_synthetic_stream(synthetic: Tokenizer, text: str) -> None:
    ids = synthetic.encode(text)
    pieces = assert_clean_stream(synthetic, ids)
    assert "".join(pieces) == text
    assert pieces.count("") > 1  # multi-byte characters were held back until complete


def test_synthetic_stream_with_special_tokens(synthetic: Tokenizer) -> None:
    ids = synthetic.encode("hi 🙂<|im_end|>世界<|endoftext|>")
    assert_clean_stream(synthetic, ids)
    pieces = assert_clean_stream(synthetic, ids, skip_special_tokens=True)
    assert "".join(pieces) == "hi 🙂世界"


def test_incomplete_character_at_end_is_dropped(synthetic: Tokenizer) -> None:
    ids = synthetic.encode("ok 🙂 x🙂")[:-1]  # cut inside the last emoji's bytes
    detok = IncrementalDetokenizer(synthetic)
    text = "".join(detok.push(i) for i in ids)
    assert text in ("ok 🙂", "ok 🙂 ", "ok 🙂 x")  # " x" may still be held with the emoji's first bytes
    assert text + detok.flush() == "ok 🙂 x"  # never a U+FFFD for the half character
    assert detok.flush() == ""


def test_window_stays_small(synthetic: Tokenizer) -> None:
    """Each step decodes only the ids since the last emitted boundary, not the whole sequence."""
    sizes: list[int] = []

    class Recording:
        def decode(self, ids, skip_special_tokens=False):
            sizes.append(len(ids))
            return synthetic.decode(ids, skip_special_tokens)

    ids = synthetic.encode("the quick brown fox 🙂 " * 50)
    pieces = stream(Recording(), ids)
    assert "".join(pieces) == synthetic.decode(ids)
    assert max(sizes) <= 8


# ---------------------------------------------------------------------------------------------------------------------
# Real tokenizers.
# ---------------------------------------------------------------------------------------------------------------------

REAL_MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b"]  # registry names, pulled on first use


@pytest.fixture(scope="module", params=REAL_MODELS)
def real_tokenizer(request, real_model) -> Tokenizer:
    return Tokenizer.load(real_model(request.param))


@pytest.mark.real
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_real_stream(real_tokenizer: Tokenizer, text: str) -> None:
    ids = real_tokenizer.encode(text)
    pieces = assert_clean_stream(real_tokenizer, ids)
    assert "".join(pieces) == text


@pytest.mark.real
def test_real_stream_with_special_tokens(real_tokenizer: Tokenizer) -> None:
    ids = real_tokenizer.encode("<|im_start|>assistant\n素晴らしい 🙂<|im_end|>")
    assert_clean_stream(real_tokenizer, ids)
    pieces = assert_clean_stream(real_tokenizer, ids, skip_special_tokens=True)
    assert "".join(pieces) == "assistant\n素晴らしい 🙂"


# ---------------------------------------------------------------------------------------------------------------------
# StopStringMatcher.
# ---------------------------------------------------------------------------------------------------------------------


def run_stop(stops: list[str], pieces: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopStringMatcher(stops)
    out, emitted, hit = [], [], False
    for piece in pieces:
        text, hit = matcher.push(piece)
        emitted.append(text)
        out.append(text)
        if hit:
            break
    out.append(matcher.flush())
    return "".join(out), hit, emitted


def test_no_stops_is_passthrough() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.push("") == ("", False)
    assert matcher.flush() == ""


def test_stop_split_across_pieces() -> None:
    text, hit, emitted = run_stop(["STOP"], ["hello S", "T", "O", "P after"])
    assert (text, hit) == ("hello ", True)
    assert emitted == ["hello ", "", "", ""]


def test_held_text_released_when_not_a_stop() -> None:
    text, hit, emitted = run_stop(["STOP"], ["hello ST", "ick", " end S"])
    assert (text, hit) == ("hello STick end S", False)
    assert emitted == ["hello ", "STick", " end "]  # the final "S" is held, then flushed


def test_earliest_stop_wins() -> None:
    assert run_stop(["world", "lo w"], ["hello world"])[:2] == ("hel", True)
    assert run_stop(["b", "abc"], ["xa", "bc"])[:2] == ("x", True)  # "abc" starts before "b"
    assert run_stop(["abc", "b"], ["xa", "bc"])[:2] == ("x", True)
    assert run_stop(["cd", "b"], ["ab", "cd"])[:2] == ("a", True)


def test_overlapping_prefixes() -> None:
    assert run_stop(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)
    assert run_stop(["abab"], ["xab", "a", "bab"])[:2] == ("x", True)
    assert run_stop(["abac"], ["ab", "ab", "ac"])[:2] == ("ab", True)
    assert run_stop(["</s>", "</stop>"], ["x</s", "top>"])[:2] == ("x", True)


def test_stop_at_very_start() -> None:
    text, hit, emitted = run_stop(["<|end|>"], ["<|end|>rest"])
    assert (text, hit, emitted) == ("", True, [""])


def test_nothing_after_stop() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.push("a\n") == ("a", False)
    assert matcher.push("\nb") == ("", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_empty_stop_strings_ignored() -> None:
    assert StopStringMatcher([""]).push("abc") == ("abc", False)
