"""Tokenizer: GGUF and tokenizer.json loading, special tokens, stop ids, and the sandboxed chat template.

Fast tests build a tiny byte-level BPE with `tokenizers`; tests marked `real` compare against
transformers' tokenizer built from the same GGUF file (the models come from the `real_model` fixture,
which pulls them on first use, so they run, never skip, on a clean machine).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as FastTokenizer, decoders, models, pre_tokenizers, trainers

from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile
from kvlab.tokenizer import Tokenizer
from kvlab.tokenizer.gguf_bpe import build_byte_level_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12345 67890",
    "def main():\n    return 42\n\tprint('hello world')",
    "héllo wörld café naïve — 世界 日本語 🙂 👍",
] * 20


def tiny_backend(pre: pre_tokenizers.PreTokenizer | None = None) -> FastTokenizer:
    """A byte-level BPE trained in milliseconds on a few lines, with ChatML special tokens."""
    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def backend() -> FastTokenizer:
    return tiny_backend()


def write_model_dir(path: Path, backend: FastTokenizer, config: dict, generation: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture
def chat_dir(tmp_path: Path, backend: FastTokenizer) -> Path:
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    return write_model_dir(tmp_path / "model", backend, config, {"eos_token_id": [2, 0]})


def write_gguf(path: Path, backend: FastTokenizer, model: str = "gpt2", pre: str = "gpt-2", **extra) -> Path:
    """A GGUF holding only tokenizer metadata, written from `backend`'s vocabulary and merges."""
    spec = json.loads(backend.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(extra.get("bos", 1))
    writer.add_eos_token_id(extra.get("eos", 2))
    writer.add_add_bos_token(extra.get("add_bos", False))
    if "add_eos" in extra:
        writer.add_add_eos_token(extra["add_eos"])
    if "chat_template" in extra:
        writer.add_chat_template(extra["chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Fast tests.
# ---------------------------------------------------------------------------------------------------------------------


def test_from_pretrained_dir(chat_dir: Path, backend: FastTokenizer) -> None:
    tok = Tokenizer.load(chat_dir)
    text = "The quick brown fox <|im_end|> 12345"
    assert tok.encode(text) == backend.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "The quick brown fox  12345"
    assert tok.eos_token_ids == (2, 0)  # tokenizer_config eos first, then generation_config's
    assert tok.bos_token_id is None and tok.pad_token_id == 0
    assert tok.is_special(2) and not tok.is_special(tok.encode("The")[0])
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.vocab_size == backend.get_vocab_size()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_dir_add_bos_and_jinja_file(tmp_path: Path, backend: FastTokenizer) -> None:
    config = {"bos_token": {"content": "<|endoftext|>"}, "add_bos_token": True, "chat_template": "ignored"}
    path = write_model_dir(tmp_path / "m", backend, config)
    (path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = Tokenizer.from_pretrained_dir(path)
    assert tok.encode("fox")[0] == 0 and tok.encode("fox", add_special_tokens=False)[0] != 0
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>x"


def test_dir_chat_template_list_and_generation_int(tmp_path: Path, backend: FastTokenizer) -> None:
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    path = write_model_dir(tmp_path / "m", backend, {"chat_template": templates}, {"eos_token_id": 2})
    tok = Tokenizer.load(path)
    assert tok.chat_template == "plain"
    assert tok.eos_token_ids == (2, 0)  # <|endoftext|> is an end-of-turn special token too


def test_missing_paths_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(KvlabError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope")
    with pytest.raises(KvlabError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(KvlabError, match="not a GGUF"):
        Tokenizer.load(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(KvlabError, match="empty.gguf"):
        Tokenizer.load(empty)


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "weights-only.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(KvlabError, match="has no tokenizer in its metadata"):
        Tokenizer.from_gguf(path)


def test_from_gguf_file_reuses_open_file(tmp_path: Path, backend: FastTokenizer) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", backend, chat_template=CHATML)
    opened = GGUFFile(path)
    tok = Tokenizer.from_gguf_file(opened)
    same = Tokenizer.from_gguf(path)
    text = CORPUS[2] + "<|im_end|>"
    assert tok.encode(text) == same.encode(text) == backend.encode(text).ids
    assert (tok.eos_token_ids, tok.chat_template) == (same.eos_token_ids, same.chat_template)


def test_gguf_tokens_respelled_as_bytes() -> None:
    """Tokens outside the byte alphabet are respelled; on a collision the first id keeps the spelling."""
    tokens = ["a", "b", "Ġ", "ab", "a b", " ", "世", "é"]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"]}
    tok = build_byte_level_bpe(meta, "test")
    assert tok.token_to_id("aĠb") == 4 and tok.token_to_id("ä¸ĸ") == 6
    assert tok.token_to_id("é") == 7  # already in the byte alphabet: kept as is
    assert tok.token_to_id("Ġ") == 2  # " " (id 5) respells to "Ġ" too
    assert tok.encode("ab").ids == [3]


def test_from_gguf_matches_source_tokenizer(tmp_path: Path, backend: FastTokenizer) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", backend, chat_template=CHATML)
    tok = Tokenizer.load(path)
    for text in CORPUS[:3] + ["<|im_start|>user\nfox<|im_end|>", "  two  spaces\n\n", ""]:
        assert tok.encode(text) == backend.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    assert tok.is_special(1) and tok.eos_token_ids == (2, 0)
    assert tok.chat_template == CHATML
    assert tok.vocab_size == backend.get_vocab_size()


def test_from_gguf_add_bos_eos(tmp_path: Path, backend: FastTokenizer) -> None:
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", backend, bos=0, add_bos=True))
    assert tok.encode("fox") == [0] + backend.encode("fox").ids
    assert tok.encode("fox", add_special_tokens=False) == backend.encode("fox").ids
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "u.gguf", backend, add_eos=True))
    assert tok.encode("fox") == backend.encode("fox").ids + [2]


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("smollm", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("qwen2", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("llama-bpe", "ab 12345", ["ab", "Ġ", "123", "45"]),
        ("gpt-2", "ab 123", ["ab", "Ġ123"]),
    ],
)
def test_pre_tokenizer_by_gguf_pre(tmp_path: Path, backend: FastTokenizer, pre: str, text: str, pieces) -> None:
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "t.gguf", backend, pre=pre))
    split = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert split == pieces


def test_unsupported_gguf_tokenizer_type(tmp_path: Path, backend: FastTokenizer) -> None:
    path = write_gguf(tmp_path / "spm.gguf", backend, model="llama")
    with pytest.raises(KvlabError, match="'llama'"):
        Tokenizer.from_gguf(path)


def test_chat_template_validation(chat_dir: Path) -> None:
    tok = Tokenizer.load(chat_dir)
    for bad in ["hi", [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": 3}], ["hi"]]:
        with pytest.raises(KvlabError):
            tok.apply_chat_template(bad)


def test_no_chat_template(tmp_path: Path, backend: FastTokenizer) -> None:
    tok = Tokenizer.load(write_model_dir(tmp_path / "m", backend, {}))
    with pytest.raises(KvlabError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    tok.chat_template, tok._template = template, None
    return tok


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}{{ ns }}",
    ],
)
def test_sandbox_blocks_escapes(chat_dir: Path, template: str) -> None:
    tok = with_template(Tokenizer.load(chat_dir), template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(KvlabError):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_raise_exception_message(chat_dir: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('Conversations must start with system') }}{% endif %}"
    )
    tok = with_template(Tokenizer.load(chat_dir), template)
    with pytest.raises(KvlabError, match="Conversations must start with system"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_syntax_error(chat_dir: Path) -> None:
    tok = with_template(Tokenizer.load(chat_dir), "{% if %}")
    with pytest.raises(KvlabError, match="invalid"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers(chat_dir: Path) -> None:
    template = (
        "{{ messages | tojson }}|{{ {'a': [1]} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
        "|{{ tools }}|{{ eos_token }}|{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}"
        "{% break %}{% endfor %}|{{ flavour }}"
    )
    tok = with_template(Tokenizer.load(chat_dir), template)
    out = tok.apply_chat_template([{"role": "user", "content": "héllo"}], flavour="x")
    assert out == '[{"role": "user", "content": "héllo"}]|{\n  "a": [\n    1\n  ]\n}|4|None|<|im_end|>|user|x'


# ---------------------------------------------------------------------------------------------------------------------
# Real models, against transformers' tokenizer from the same GGUF.
# ---------------------------------------------------------------------------------------------------------------------

REAL_MODELS = {"smollm": "smollm2-135m", "qwen": "qwen2.5-coder-0.5b"}  # registry names

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's what we've DONE, isn't it?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n\t\tx++;\n}",
    "12345678 3.14159 1,000,000 -42 0x1F 2024-01-31",
    "naïve café résumé Ångström ß straße",
    "Привет, мир! Γειά σου Κόσμε",
    "你好，世界！今天天气很好。日本語のテキスト、한국어 텍스트",
    "emoji 🙂👍🏽🇫🇷 family 👨‍👩‍👧‍👦 sparkles ✨",
    "multiple     spaces   here  ",
    "   leading spaces and trailing   ",
    "line one\nline two\n\n\nline five\r\nwindows\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|im_start|>",
    "a <|im_end|>b",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "https://example.com/path?query=1&x=y#frag",
    "\t\t  \n  \t mixed whitespace",
    "",
    "😀",
]

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "user_only": [{"role": "user", "content": "Write a haiku about the sea 🌊."}],
    "multi_turn": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say 'bye' in 世界 languages.\n\tThanks"},
    ],
}


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real_pair(request, real_model, transformers_reference):
    """(our Tokenizer, transformers' tokenizer of the same file, load seconds) for each real GGUF."""
    import transformers  # noqa: F401 (a dev dependency: CI must fail, not skip, without it)

    path = real_model(REAL_MODELS[request.param])
    start = time.perf_counter()
    ours = Tokenizer.load(path)
    seconds = time.perf_counter() - start
    return ours, transformers_reference(path).tokenizer, seconds


@pytest.mark.real
@pytest.mark.parametrize("text", TEXTS)
def test_real_encode_decode(real_pair, text: str) -> None:
    ours, ref, _ = real_pair
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_real_chat_template(real_pair, name: str) -> None:
    ours, ref, _ = real_pair
    messages = CONVERSATIONS[name]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected


@pytest.mark.real
def test_real_special_ids(real_pair) -> None:
    ours, ref, _ = real_pair
    assert ours.vocab_size == len(ref)
    assert ours.eos_token_ids[0] == ref.eos_token_id
    assert ours.bos_token_id == ref.bos_token_id
    for token_id, added in ref.backend_tokenizer.get_added_tokens_decoder().items():
        assert ours.is_special(token_id) == added.special
        assert ours.id_to_token(token_id) == added.content
    end_of_turn = {ours.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert end_of_turn <= set(ours.eos_token_ids)


@pytest.mark.real
def test_real_smollm_isolates_digits(real_model) -> None:
    """SmolLM's vocabulary was trained with every digit split off (llama.cpp's "smollm" pre-tokenizer).

    transformers' GGUF path uses plain GPT-2 splitting for this file, so the two differ on e.g. spaces
    before a digit; we follow llama.cpp and the model's own tokenizer.json.
    """
    tok = Tokenizer.load(real_model(REAL_MODELS["smollm"]))
    assert [tok.id_to_token(i) for i in tok.encode("x  5 ²")] == ["x", "ĠĠ", "5", "Ġ", "Â²"]


@pytest.mark.real
def test_real_qwen_stop_ids(real_model) -> None:
    tok = Tokenizer.load(real_model(REAL_MODELS["qwen"]))
    assert tok.eos_token_ids == (151645, 151643)  # <|im_end|>, then <|endoftext|> as in generation_config.json
