"""Structured outputs: a grammar's token mask, applied to the logits before sampling (llguidance).

    GrammarCompiler(tokenizer, vocab_size, eos_ids)   one per engine: the vocabulary as llguidance sees it
      .compile(spec) → Grammar                        JSON schema, JSON object, regex, choice or Lark;
                                                      a KvlabError naming the problem if it cannot compile
    Grammar.matcher() → GrammarMatcher                one per sequence: its place in the grammar
      .fill(bitmask_row) / .consume(token)            the allowed tokens now; advance by the sampled one

Why llguidance (measured here, SmolLM2's 49,152-token vocabulary, one thread, a three-field JSON
schema): it computes each mask lazily from a token trie — 10 µs a token (median; 40 µs p90, 1.5 ms
for the first) and 0.7 ms to compile the schema, with no index to build over the vocabulary and no
dependency (one 3 MB wheel). outlines-core took 0.8 ms a token to hand back the allowed ids;
xgrammar needs transformers and triton at run time. llguidance also reads Lark grammars with JSON
schemas inside (`%json`), which the tool-call grammar uses. It is imported on first use only.

llguidance builds its lexer lazily, so some grammars pass its validation and fail only mid-answer (a
`pattern` of `^(a{1000}){1000}$` exhausts the lexer once the string opens; `$ref`s that point at each
other never produce a value). So `compile` also refuses, before any work: `$ref`/`allOf`/`anyOf`/`oneOf`
chains that loop without consuming input, every `pattern` that fails alone, and a grammar that fails
within a few probe walks (PROBE_WALKS × PROBE_STEPS tokens, the first always taking the lowest allowed
token, the others seeded random ones). What still fails mid-answer raises `GrammarFailed` from `fill`:
the engine ends that request with the error (the server: a 500 `structured_output_failed`, or an
error event in a stream), never with an answer that does not parse.
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch

from kvlab.errors import KvlabError
from kvlab.sampling.params import StructuredOutputs

_SHIFTS = torch.arange(32, dtype=torch.int32)
# Whitespace between JSON tokens, bounded (one space, or a newline and its indent): unbounded, a sampled answer can spend max_tokens on spaces
# (llama.cpp's JSON grammars bound it too). Schemas may override it with their own "x-guidance".
JSON_OPTIONS = {"whitespace_pattern": r"(?:\n[ \t]{0,20}| )?"}  # nothing, a space, or a newline and its indent
PROBE_WALKS, PROBE_STEPS = 3, 24  # compile's probe: walks into a new grammar, tokens each (a few ms in all)
_ALIAS_KEYS = ("allOf", "anyOf", "oneOf")  # a schema's members that apply before it consumes any input


class GrammarFailed(KvlabError):
    """The grammar engine failed mid-answer: the text so far cannot be completed into one that parses."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a base dependency; only a broken install lacks it
        raise KvlabError("structured outputs need the llguidance package: pip install llguidance") from None
    return llguidance


def grammar_source(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of a structured-output spec; never raises for bad grammars."""
    llg = _llguidance()
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise KvlabError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise KvlabError("the JSON schema must be an object")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.json_object:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:  # JSON string literals are Lark string literals
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llg.LLMatcher.grammar_from_lark(spec.grammar)


class GrammarCompiler:
    """Compiles specs against one vocabulary. Thread-safe: the server checks specs in worker threads
    while the engine thread makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 64):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size = cache_size

    def _vocabulary(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise KvlabError("structured outputs need the model's tokenizer")
                llg = _llguidance()
                # the model's own vocabulary size: rows of the LM head past the tokenizer's are never allowed
                self._ll_tokenizer = llg.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_token_ids) or None)  # fmt: skip
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> Grammar:
        source = grammar_source(spec)
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
        vocabulary = self._vocabulary()
        error = _llguidance().LLMatcher.validate_grammar(source, vocabulary)
        if error and not error.startswith("WARNING"):
            raise KvlabError(f"cannot compile the structured output: {_first_line(error)}")
        grammar = Grammar(source, vocabulary, self.eos_token_ids)
        if spec.json is not None:
            _check_schema(spec.json if isinstance(spec.json, dict) else json.loads(spec.json), self)
        error = _probe(grammar)
        if error is not None:
            raise KvlabError(f"cannot compile the structured output: the grammar {error}")
        with self._lock:
            self._cache[source] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar


def _first_line(error: str) -> str:
    return re.sub(r"\s+", " ", error.strip().splitlines()[0] if error.strip() else error)[:300]


def _check_schema(schema: dict, compiler: GrammarCompiler) -> None:
    """A JSON schema's parts llguidance only trips on mid-answer: looping $refs, patterns its lexer cannot build."""
    nodes, patterns = _schema_nodes(schema)
    if _alias_loop(schema, nodes):
        raise KvlabError("cannot compile the structured output: its $refs (or allOf/anyOf/oneOf) loop without "
                         "ever producing a value")  # fmt: skip
    for pattern in dict.fromkeys(patterns):
        source = _llguidance().LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
        error = _probe(Grammar(source, compiler._vocabulary(), compiler.eos_token_ids), walks=1, steps=4)
        if error is not None:
            raise KvlabError(f"cannot compile the structured output: the pattern {pattern!r:.60} {error}")


_DATA_KEYS = ("const", "enum", "default", "examples")  # values, not schemas: a "pattern" key there is data


def _schema_nodes(schema) -> tuple[list[dict], list[str]]:
    """Every schema object inside a schema, and every string `pattern` among them (iterative: no recursion limit)."""
    nodes, patterns, stack = [], [], [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            nodes.append(value)
            if isinstance(value.get("pattern"), str):
                patterns.append(value["pattern"])
            stack.extend(v for k, v in value.items() if k not in _DATA_KEYS)
        elif isinstance(value, list):
            stack.extend(value)
    return nodes, patterns


def _alias_loop(root: dict, nodes: list[dict]) -> bool:
    """Whether following what a schema is before it reads any input ($ref, allOf/anyOf/oneOf members) loops
    (a depth-first search with colours over those edges: linear in the schema, no recursion)."""
    state: dict[int, int] = {}  # id(node) → 1 on the current path, 2 done
    for start in nodes:
        if id(start) in state:
            continue
        state[id(start)] = 1
        path = [(start, iter(_aliases(root, start)))]
        while path:
            node, edges = path[-1]
            target = next(edges, None)
            if target is None:
                state[id(node)] = 2
                path.pop()
            elif state.get(id(target)) == 1:
                return True
            elif id(target) not in state:
                state[id(target)] = 1
                path.append((target, iter(_aliases(root, target))))
    return False


def _aliases(root: dict, node: dict) -> list[dict]:
    targets = [m for key in _ALIAS_KEYS if isinstance(node.get(key), list) for m in node[key] if isinstance(m, dict)]
    ref = node.get("$ref")
    target = _pointer(root, ref[1:]) if isinstance(ref, str) and ref.startswith("#") else None
    return targets + [target] if isinstance(target, dict) else targets


def _pointer(root: dict, pointer: str):
    """A JSON pointer ("/$defs/a") inside `root`, or None."""
    value = root
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _probe(grammar: Grammar, walks: int | None = None, steps: int | None = None) -> str | None:
    """Walk a new grammar a few tokens deep, as answers would (the lowest allowed token, then seeded random
    ones), so that a lexer or parser that fails on the way fails here, before any work. The failure, or None."""
    walks, steps = PROBE_WALKS if walks is None else walks, PROBE_STEPS if steps is None else steps
    rng = random.Random(0)
    eos = set(grammar.eos_token_ids)
    for walk in range(walks):
        m = grammar.matcher()
        for _ in range(steps):
            allowed = m.allowed()
            if m.error is not None:
                return f"fails after {m.num_consumed} tokens: {m.error}"
            choices = [t for t in allowed if t not in eos]
            if not choices:
                if not allowed:
                    return f"allows no token after {m.num_consumed} tokens"
                break  # complete: only end-of-sequence is left
            m.consume(choices[0] if walk == 0 else rng.choice(choices))
    return None


class Grammar:
    def __init__(self, source: str, vocabulary, eos_token_ids: tuple[int, ...]):
        self.source, self.vocabulary, self.eos_token_ids = source, vocabulary, eos_token_ids

    def matcher(self) -> GrammarMatcher:
        limits = _llguidance().LLParserLimits(verbose_errors=False)  # its errors reach clients: no parser dumps
        matcher = _llguidance().LLMatcher(self.vocabulary, self.source, log_level=0, limits=limits)
        return GrammarMatcher(matcher, self.eos_token_ids)


class GrammarMatcher:
    """One sequence's place in its grammar. Once the grammar is complete only end-of-sequence is allowed;
    a grammar engine that fails (or allows nothing) raises GrammarFailed rather than end the answer."""

    def __init__(self, matcher, eos_token_ids: tuple[int, ...]):
        self._m, self.eos_token_ids = matcher, eos_token_ids
        self.num_consumed = 0  # tokens consumed

    def fill(self, bitmask: torch.Tensor) -> None:
        """bitmask [W] int32 (W = ceil(V / 32)), contiguous: bit t of word t // 32 set = token t allowed."""
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        if self._m.is_error():
            raise GrammarFailed(f"the structured output's grammar failed after {self.num_consumed} tokens: "
                                f"{self.error}")  # fmt: skip
        if not bool(bitmask.any()):
            raise GrammarFailed(f"the structured output's grammar allows no token after {self.num_consumed} tokens")

    def allowed(self) -> list[int]:
        """The token ids allowed now (compile's probe; sampling uses `fill`)."""
        mask = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.uint8)
        bits = (mask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [bytes, 8]: bit t % 8 of byte t // 8
        return bits.flatten().nonzero().flatten().tolist()

    @property
    def error(self) -> str | None:
        return _first_line(self._m.get_error()) if self._m.is_error() else None

    def consume(self, token_id: int) -> bool:
        self.num_consumed += 1
        return bool(self._m.consume_token(token_id))

    @property
    def is_error(self) -> bool:
        return bool(self._m.is_error())


def apply_bitmasks(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
    """Set the logits of every token a row's grammar does not allow to -inf (in place). logits [D, V]."""
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill(bitmask[i])
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), -1)[:, :vocab].bool()  # [G, V]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
