"""Chat templates, rendered in a sandboxed, immutable Jinja environment.

Templates come from downloaded files and must not be able to run arbitrary code: the sandbox refuses
attribute access to internals (and fails at once rather than rendering them as empty), cannot mutate the
messages, and `namespace()` refuses underscore-prefixed names. The helpers Hugging Face templates
expect (`raise_exception`, `tojson`, `strftime_now`, `{% generation %}`, loop controls) are provided.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlab.errors import KvlabError

# ---------------------------------------------------------------------------------------------------------------------
# The sandbox and the helpers templates call.
# ---------------------------------------------------------------------------------------------------------------------


class _TemplateRaised(jinja2.TemplateError):
    """A template called `raise_exception(message)`."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attribute names (no reaching into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but touching an unsafe attribute fails at once instead of rendering as empty."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed"
        )


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


# ---------------------------------------------------------------------------------------------------------------------
# Compiling and rendering.
# ---------------------------------------------------------------------------------------------------------------------


def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in a fresh sandbox; KvlabError on a syntax error."""
    try:
        return _chat_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise KvlabError(f"the model's chat template is invalid (line {e.lineno}): {e.message}") from e


def validated_messages(messages: Any) -> list[dict]:
    """Plain copies of the messages, after checking each is a dict with a string `role` and `content`."""
    if not isinstance(messages, (list, tuple)):
        raise KvlabError(f"chat messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise KvlabError(f"chat message {i} must be an object with 'role' and 'content', got {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise KvlabError(f"chat message {i} has no 'role' (expected e.g. 'system', 'user', 'assistant')")
        if not isinstance(content, str):
            raise KvlabError(f"chat message {i} ('{role}') needs a string 'content', got {type(content).__name__}")
        out.append(copy.deepcopy(dict(message)))  # the caller's messages stay untouched
    return out


def render_chat_template(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Render a conversation with a compiled chat template; every failure becomes a KvlabError.

    `special_tokens` gives the texts of `bos_token`, `eos_token`, `pad_token` and `unk_token` (missing ones
    render as ""); `extra` is passed to the template last (e.g. `tools=[...]`, `enable_thinking=False`).
    """
    context: dict[str, Any] = {
        "messages": validated_messages(messages),
        "add_generation_prompt": add_generation_prompt,
        "tools": None,
        "documents": None,
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        context[name] = (special_tokens or {}).get(name) or ""
    context.update(extra or {})
    try:
        return template.render(**context)
    except _TemplateRaised as e:
        raise KvlabError(f"the chat template rejected the conversation: {e.message}") from e
    except jinja2.exceptions.SecurityError as e:
        raise KvlabError(f"the chat template tried something unsafe and was stopped: {e}") from e
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise KvlabError(f"the chat template failed to render: {type(e).__name__}: {e}") from e
