"""Thinking split from the answer (issue 27, item 4): the parser's split is exact whether a tag arrives whole,
in pieces across tokens, unclosed or not at all; then `kvlab serve --reasoning-parser` on a tiny model with a
<think> chat template and scripted answers, through every wire format: reasoning_content (chat completions,
streamed as its own deltas), `thinking` (Ollama), thinking blocks (Anthropic), reasoning items (Responses);
`enable_thinking` / `think` reaching the template; a max_tokens that ends inside the thinking saying so.
"""

from __future__ import annotations

import json
import shutil

import pytest
from scripted import scripted

from loopback import serving
from kvlab.server.reasoning import ThinkSplitter, opens_thinking, split

TEXT = "<think>I should greet.</think>Hello!"


def run(pieces: list[str], inside: bool = False) -> tuple[str | None, str, bool]:
    s = ThinkSplitter(inside=inside)
    thinking, answer = [], []
    for p in pieces:
        t, a = s.push(p)
        thinking.append(t)
        answer.append(a)
    unfinished = s.unfinished
    t, a = s.flush()
    started = inside or s.done or unfinished or s.unfinished
    return ("".join(thinking) + t if started else None), "".join(answer) + a, unfinished or s.unfinished


@pytest.mark.parametrize("pieces, inside, expected", [
    (["<think>", "I should greet.", "</think>", "Hello!"], False, ("I should greet.", "Hello!", False)),  # whole tags
    (["<th", "ink>I sh", "ould greet.</th", "in", "k>Hel", "lo!"], False, ("I should greet.", "Hello!", False)),
    (["\n<think>a", "</think>\n\nb"], False, ("a", "\n\nb", False)),  # whitespace before the tag: not the answer's
    (["<think>", "still going"], False, ("still going", "", True)),  # unclosed: all thinking, and it says so
    (["<think>ab</th"], False, ("ab</th", "", True)),  # a piece of the closing tag that never completed
    (["<think>"], False, ("", "", True)),
    (["Hello ", "world"], False, (None, "Hello world", False)),  # absent
    (["<b>bold</b>"], False, (None, "<b>bold</b>", False)),  # a tag that is not <think>
    (["Hi </think> there"], False, (None, "Hi </think> there", False)),  # a closing tag in an answer stays text
    (["<think>a</think>b<think>c</think>"], False, ("a", "b<think>c</think>", False)),  # only the first block
    (["I should greet.</think>", "Hello!"], True, ("I should greet.", "Hello!", False)),  # the template opened it
    (["no close"], True, ("no close", "", True)),
])  # fmt: skip
def test_the_split_is_exact(pieces, inside, expected):
    assert run(pieces, inside) == expected
    assert split("".join(pieces), inside) == expected  # whole, the same


@pytest.mark.parametrize("text", [TEXT, "<think>x</think>", "plain", "<think>open", "\n<think>\n</think>\n\nok"])
def test_every_cut_into_pieces_splits_the_same(text):
    whole = split(text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run([text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert run(list(text)) == whole  # one character at a time


def test_where_the_prompt_leaves_the_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


# ---- through the server -------------------------------------------------------------------------------------

# Qwen3's switch (enable_thinking false writes an empty thinking block) and DeepSeek's (thinking true opens one)
THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif thinking is defined and thinking %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def think_model(tiny_chat_model, tmp_path_factory):
    """The tiny model with <think> and </think> added to its vocabulary, not special (as in Qwen3's)."""
    from tiny import add_tiny_tokenizer
    from tokenizers import AddedToken, Tokenizer

    directory = tmp_path_factory.mktemp("tiny-think")
    for f in tiny_chat_model.iterdir():
        shutil.copy(f, directory / f.name)
    add_tiny_tokenizer(directory, vocab_size=510)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def server(think_model, one_thread):
    from kvlab import LLM

    with serving(LLM(think_model, max_model_len=256), reasoning_parser="qwen3") as s:
        yield s


QUESTION = [{"role": "user", "content": "hello"}]


def tokens(server, text: str, whole_tags: bool = True) -> list[int]:
    """The text's token ids: its tags as the added tokens they are, or spelled one character a token."""
    tok = server.llm.tokenizer
    if whole_tags:
        return tok.encode(text, add_special_tokens=False)
    return [i for ch in text for i in tok._encode_plain(ch)]


def chat(server, **fields) -> dict:
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 40, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server, **fields) -> tuple[str, str, list[dict]]:
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 40, "stream": True,
                                             **fields})  # fmt: skip
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    return "".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas), chunks


@pytest.mark.parametrize("whole_tags", [True, False])
def test_chat_completions_split_reasoning_content(server, whole_tags):
    ids = tokens(server, TEXT, whole_tags)
    assert (len(ids) < len(TEXT)) is whole_tags  # spelled: one token a character
    with scripted(server.llm, ids):
        message = chat(server)["choices"][0]["message"]
        streamed = chat_stream(server)
    assert message["reasoning_content"] == "I should greet." and message["content"] == "Hello!"
    assert streamed[:2] == ("I should greet.", "Hello!")
    server.assert_still_serving()


def test_an_answer_without_thinking_and_one_cut_inside_it(server):
    with scripted(server.llm, tokens(server, "Just hello.")):
        message = chat(server)["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == "Just hello."
    with scripted(server.llm, tokens(server, "<think>a long thought that goes on")):
        cut = chat(server, max_tokens=4)
        thinking, content, chunks = chat_stream(server, max_tokens=4)
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] and cut["kvlab"]["thinking_unfinished"] is True
    assert thinking == choice["message"]["reasoning_content"] and content == ""
    assert chunks[-1]["kvlab"]["thinking_unfinished"] is True


def test_the_templates_switches_reach_it(server):
    plain = chat(server, max_tokens=1)["usage"]["prompt_tokens"]
    off = chat(server, max_tokens=1, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert off > plain  # the template wrote its empty thinking block
    with scripted(server.llm, tokens(server, "opened by the template</think>done")):  # DeepSeek's: no <think> said
        message = chat(server, chat_template_kwargs={"thinking": True})["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "done", "reasoning_content": "opened by the template"}
    r = server.post("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "chat_template_kwargs": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_ollama_gives_thinking(server):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url)
    with scripted(server.llm, tokens(server, TEXT, whole_tags=False)):
        r = client.chat(model="tiny", messages=QUESTION, think=True)
        parts = list(client.chat(model="tiny", messages=QUESTION, think=True, stream=True))
        g = client.generate(model="tiny", prompt="hello", think=True)
    assert (r.message.thinking, r.message.content) == ("I should greet.", "Hello!")
    assert "".join(p.message.thinking or "" for p in parts) == "I should greet."
    assert "".join(p.message.content for p in parts) == "Hello!"
    assert (g.thinking, g.response) == ("I should greet.", "Hello!")
    off = client.chat(model="tiny", messages=QUESTION, think=False, options={"num_predict": 1})
    on = client.chat(model="tiny", messages=QUESTION, think=True, options={"num_predict": 1})
    assert off.prompt_eval_count > on.prompt_eval_count  # think: false renders the empty thinking block
    assert "thinking" in client.show("tiny").capabilities


def test_anthropic_gives_thinking_blocks(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with scripted(server.llm, tokens(server, TEXT)):
        m = client.messages.create(model="tiny", max_tokens=40, messages=QUESTION,
                                   thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
        with client.messages.stream(model="tiny", max_tokens=40, messages=QUESTION) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    for message in (m, final):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "I should greet." and message.content[1].text == "Hello!"
    assert "thinking_delta" in deltas and "text_delta" in deltas


def test_responses_give_a_reasoning_item(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with scripted(server.llm, tokens(server, TEXT)):
        r = client.responses.create(model="tiny", input="hello", reasoning={"effort": "low"}, max_output_tokens=40)
        events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=40, stream=True))
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == "Hello!"
    assert r.output[0].content[0].text == "I should greet." and r.usage.output_tokens_details.reasoning_tokens > 0
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == "I should greet." and [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    with scripted(server.llm, tokens(server, "<think>never ends")):
        cut = client.responses.create(model="tiny", input="hello", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.output[0].type == "reasoning" and cut.output[0].status == "incomplete"
