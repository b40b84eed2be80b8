"""Tool calls over the OpenAI API: tools checked and rendered by the model's own chat template, the
model's markup parsed back into `tool_calls`.

    tool_spec(body, template)            `tools` + `tool_choice` + `parallel_tool_calls` → ToolSpec (or None)
    ToolSpec.grammar()                   "required" / a named function: the Lark grammar the answer must follow
    parse_tool_calls(text)               (content, tool_calls) from a finished answer
    ToolStream                           the same, streamed: content deltas, and each call once it closes

Small models sometimes answer with the call object alone, without the markup (in a ```json fence):
when that object names one of the tools, it is the call (an answer that starts with `{` or a fence
is held back while streaming until it ends, to tell).

kvlab parses Hermes-style markup — `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` —
which Qwen2.5's template teaches its models (and Hermes, Qwen3 and others use). A template without a
tools section (SmolLM2's) cannot show the model the tools: such a request is refused with a 400.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvlab.sampling.structured import JSON_OPTIONS
from kvlab.server.errors import invalid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolSpec:
    tools: list[dict]  # as the client sent them: [{"type": "function", "function": {...}}]
    choice: str  # "auto", "required", or "function" (a named one)
    name: str | None = None  # the named function
    parallel: bool | None = None  # parallel_tool_calls; a forced call is one call unless it is true
    marker_tokens: bool = False  # <tool_call> and </tool_call> are vocabulary entries of their own (Qwen2.5's)

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools if self.name is None or t["function"]["name"] == self.name]

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance) that forces a call, for "required" and a named function."""
        if self.choice == "auto":
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": f.get("parameters") or {"type": "object"}}}
                 for f in self.functions]  # fmt: skip
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        # one call unless parallel calls were asked for (a small model forced to call tends to call forever)
        repeat = ' ("\\n" call)*' if self.parallel is True and self.name is None else ""
        # a marker that is a token of its own is named as a token (llguidance's <...>): its text never forms
        open_, close = (OPEN, CLOSE) if self.marker_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
        return f'start: call{repeat}\ncall: {open_} "\\n" body "\\n" {close}\nbody: %json {json.dumps(schema)}\n'


def markers_are_tokens(tokenizer) -> bool:
    """Whether <tool_call> is an added token of the vocabulary (the grammar must then name it as a token)."""
    if tokenizer is None:
        return False
    return OPEN in {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}


def template_has_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template and OPEN in template


def tool_spec(body: dict, template: str | None, model: str) -> ToolSpec | None:
    """The request's tools, or None when it has none (or tool_choice "none": the template renders none)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    checked = _tools(tools)
    name = _choice_name(choice, checked)
    if choice == "none":
        return None
    if not template_has_tools(template):
        raise invalid(f"the chat template of {model} has no tools section (and no Hermes <tool_call> markup): "
                      "tool calls need a model whose template renders tools, e.g. qwen2.5-coder-0.5b", "tools")  # fmt: skip
    kind = "function" if name else (choice or "auto")
    return ToolSpec(checked, kind, name, parallel)


def parameter_schemas(body: dict) -> list[dict]:
    """Every tool's parameters schema, under any tool_choice (call after tool_spec has checked `tools`): the
    server compiles each, so a schema the grammar engine cannot read is a 400 whether or not a call is forced."""
    return [t["function"].get("parameters") or {"type": "object"} for t in body.get("tools") or []]


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    seen = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(f, dict)
            or set(t) - {"type", "function"}
        ):
            raise invalid(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}", "tools")
        if set(f) - {"name", "description", "parameters", "strict"}:
            raise invalid(
                f"tools[{i}].function has unknown fields: {', '.join(sorted(set(f) - {'name', 'description', 'parameters', 'strict'}))}",
                "tools",
            )
        if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]) or f["name"] in seen:
            raise invalid(f"tools[{i}].function.name must be a unique name of 1-64 letters, digits, _ or -", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise invalid(f"tools[{i}].function.description must be a string", "tools")
        seen.add(f["name"])
    return tools


def _choice_name(choice: Any, tools: list[dict]) -> str | None:
    if choice is None or choice in ("none", "auto", "required"):
        return None
    names = [t["function"]["name"] for t in tools]
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    if not isinstance(name, str):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                      "tool_choice")  # fmt: skip
    if name not in names:
        raise invalid(f"'tool_choice' names {name!r:.80}, which is not in 'tools'", "tool_choice")
    return name


# ---- messages on the way in -------------------------------------------------------------------------------


def assistant_tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's `tool_calls`, for the template: arguments parsed back into objects (templates
    write them with `tojson`)."""
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments", ""), str):
            raise invalid(f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                          "'arguments': <JSON text>}}}}", "messages")  # fmt: skip
        try:
            arguments = json.loads(f.get("arguments") or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # the template would show the model a call no parser gives back
            raise invalid(f"{where}.tool_calls[{j}].function.arguments must be the JSON text of an object, got "
                          f"{f['arguments']!r:.80}", "messages")  # fmt: skip
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": arguments}})
    return out


# ---- the answer on the way out -----------------------------------------------------------------------------


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _bare_call(text: str, names: set[str]) -> dict | None:
    """A small model's call without the markup: the whole answer one {"name", "arguments"} object (perhaps
    in a ```json fence) naming one of the tools."""
    body = text.strip()
    fenced = _FENCE.match(body)
    call = _call(fenced.group(1) if fenced else body) if body.startswith(("{", "```")) else None
    return call if call is not None and call["function"]["name"] in names else None


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, tool calls). Markup that does not parse stays content; with the
    tools' `names`, an answer that is only a bare call object counts too."""
    bare = _bare_call(text, names) if names else None
    if bare is not None and OPEN not in text:
        return None, [bare]
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    if not calls:
        return text, []
    content = ("".join(kept) + text[at:]).strip()
    return content or None, calls


@dataclass
class ToolStream:
    """Streamed text in, content deltas and whole calls out. Text that could begin `<tool_call>` is held
    back until it can tell; a call is sent once its `</tool_call>` arrives, as one delta."""

    names: set[str] = field(default_factory=set)  # the tools: an answer that starts like a bare call is held
    held: str = ""
    inside: bool = False
    num_calls: int = 0
    calls: list[dict] = field(default_factory=list)
    bare: bool | None = None  # None: cannot tell yet whether the answer is a bare call object

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        if self.bare is None and self.names:
            start = self.held.lstrip()
            if not start:
                return "", []
            self.bare = start.startswith(("{", "```"))
        if self.bare:
            return "", []  # decided at the end (flush)
        content, new = [], []
        while True:
            if self.inside:
                end = self.held.find(CLOSE)
                if end < 0:
                    break
                body, self.held, self.inside = self.held[:end], self.held[end + len(CLOSE) :], False
                call = _call(body.strip())
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    new.append({"index": self.num_calls, **call})
                    self.num_calls += 1
                continue
            start = self.held.find(OPEN)
            if start >= 0:
                content.append(self.held[:start])
                self.held, self.inside = self.held[start + len(OPEN) :], True
                continue
            keep = _partial(self.held)
            content.append(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]
            break
        self.calls += new
        return "".join(content), new

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: whatever is held (an unclosed call stays text), or the bare call it was."""
        if self.bare:
            self.bare = False
            text, self.held = self.held, ""
            call = _bare_call(text, self.names)
            if call is None:
                return self.push(text)[0] + self.flush()[0], []
            self.calls.append(call)
            self.num_calls += 1
            return "", [{"index": 0, **call}]
        held, self.held = (OPEN if self.inside else "") + self.held, ""
        return held, []


def _partial(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of OPEN."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
