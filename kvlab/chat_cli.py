"""`kvlab chat` (and `kvlab run MODEL` on a terminal without a prompt): the interactive loop.

As in ollama and llama.cpp: line editing and history (the standard library's readline; the history
is kept in $KVLAB_HOME/chat_history), a message over several lines between triple quotes, slash
commands (/help), and Ctrl-C that stops the answer and returns to the prompt. What was answered so
far stays in the conversation, and its K/V in the prefix cache, so the next turn prefills only its
new tokens. A second Ctrl-C at an empty prompt leaves, as does Ctrl-D or /bye.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from dataclasses import dataclass, field

from kvlab.errors import KvlabError
from kvlab.engine_cli import dtype_text, open_llm_advised, sampling_params, threads_text, warn_if_busy

HELP = """Commands:
  /set temperature 0.7   set a sampling value: temperature, top_p, top_k, min_p, max_tokens,
                         repetition_penalty, seed (ollama's `/set parameter NAME VALUE` works too)
  /set system TEXT       set the system message (and start the conversation again)
  /show                  the model and the settings in force
  /clear                 forget the conversation (the system message and settings stay)
  /bye                   leave (also /exit, Ctrl-D, or Ctrl-C twice at an empty prompt)
  /help                  this text
Begin a message with \"\"\" to write it over several lines; end it with \"\"\".
Ctrl-C during an answer stops it; what was said so far stays in the conversation."""

SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
            "repetition_penalty": float, "seed": int}  # fmt: skip
LEAVE = ("/bye", "/exit", "/quit")


@dataclass
class Conversation:
    """The system message, the turns so far, and the sampling settings of the next answers."""

    params: object  # SamplingParams
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # user and assistant messages, in order

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


def run_chat(args) -> int:
    convo = Conversation(sampling_params(args), system=args.system)
    llm = open_llm_advised(args)
    try:
        if llm.tokenizer is None or llm.tokenizer.chat_template is None:
            raise KvlabError(f"{args.model} has no chat template: use `kvlab run MODEL PROMPT` with a raw prompt")
        warn_if_busy(llm, args)
        resume_conversation(convo, args)
        save_history = line_editing()
        print(f"kvlab chat with {args.model} ({dtype_text(llm, args)} on {args.device}, {threads_text(llm, args)}). "
              "/help for commands; Ctrl-D or /bye leaves.", file=sys.stderr)  # fmt: skip
        return chat_loop(llm, convo, args, save_history)
    finally:
        llm.close()  # the prompt cache's queued blocks written (--prompt-cache-dir), its threads stopped


def chat_loop(llm, convo: Conversation, args, save_history=lambda: None) -> int:
    session = llm.new_session() if not args.no_cache else None
    interrupted = False  # the last thing that happened was a Ctrl-C: a second one at an empty prompt leaves
    while True:
        try:
            text = read_message(input)
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            if interrupted and not _line_buffer():
                print(file=sys.stderr)
                return 0
            interrupted = not _line_buffer()  # Ctrl-C over typed text only clears the line
            print("\n(Ctrl-C again at an empty prompt, Ctrl-D or /bye leaves)", file=sys.stderr)
            continue
        interrupted = False
        save_history()  # now, not at exit: a closed terminal kills the process without a word
        if text.strip().startswith("/"):
            if text.strip().split()[0] in LEAVE:
                return 0
            if command(text.strip(), llm, convo, args):
                session = llm.new_session() if session is not None else None
                keep_conversation(convo, args)
            continue
        if text.strip():
            interrupted = answer(llm, convo, text, session)
            keep_conversation(convo, args)


def conversation_file(args):
    """Where a chat with --prompt-cache-dir keeps its conversation (one per model), None without the dir:
    the blocks on disk hold its K/V, this file its text, so a restart prefills only the new turn."""
    import re
    from pathlib import Path

    directory = getattr(args, "prompt_cache_dir", None)
    if not directory:
        return None
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(args.model)).name) or "model"
    return Path(directory) / "conversations" / f"{name}.json"


def resume_conversation(convo: Conversation, args) -> None:
    """Take up the conversation kept for this model and system message (--prompt-cache-dir), if any."""
    import json

    path = conversation_file(args)
    if path is None or not path.exists():
        return
    try:
        kept = json.loads(path.read_text())
        turns = [{"role": str(t["role"]), "content": str(t["content"])} for t in kept["turns"]]
    except (OSError, ValueError, KeyError, TypeError):
        print(f"kvlab: {path} is not a conversation kvlab kept: starting a new one", file=sys.stderr)
        return
    if kept.get("system") != convo.system or not turns:
        return
    convo.turns[:] = turns
    print(f"(resuming the conversation of {len(turns)} messages kept in {path}; /clear starts a new one)",
          file=sys.stderr)  # fmt: skip


def keep_conversation(convo: Conversation, args) -> None:
    """Write the conversation beside the prompt cache's blocks (atomically; a failure is one line, once)."""
    import json
    import os

    path = conversation_file(args)
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"system": convo.system, "turns": convo.turns}, ensure_ascii=False))
        os.replace(tmp, path)
    except OSError as e:
        if not getattr(args, "_conversation_unsaved", False):
            args._conversation_unsaved = True
            print(f"kvlab: cannot keep the conversation in {path}: {e.strerror or e}", file=sys.stderr)


def read_message(ask) -> str:
    """One message from `ask` (input): a line, or the lines between triple quotes (ollama's \"\"\")."""
    line = ask(">>> ")
    if not line.lstrip().startswith('"""'):
        return line
    body = line.lstrip()[3:]
    if body.rstrip().endswith('"""'):  # """all on one line"""
        return body.rstrip()[:-3]
    lines = [body]
    while True:
        more = ask("... ")
        if more.rstrip().endswith('"""'):
            lines.append(more.rstrip()[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(more)


def answer(llm, convo: Conversation, text: str, session) -> bool:
    """Stream the model's answer to `text`; return whether Ctrl-C stopped it.

    Ctrl-C only raises a flag, read between engine steps: an interrupt inside a step could leave the
    scheduler's or the block pool's books half written. The stopped request is aborted (its blocks go
    back to the pool, the full ones findable by the prefix cache) and its text so far is kept."""
    convo.turns.append({"role": "user", "content": text})
    stopped: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stopped.append(True))
    try:
        stream = llm.chat_stream(convo.messages(), convo.params, session=session)
        pieces = iter(stream)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
            if stopped:
                break
        pieces.close()  # a stopped answer: abort the request now, not when the generator is collected
    except KvlabError as e:
        convo.turns.pop()  # the message never reached the model (too long for the context, ...)
        print(f"kvlab: error: {e}", file=sys.stderr)
        return False
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    out = stream.output
    convo.turns.append({"role": "assistant", "content": out.text})
    print(turn_report(out, bool(stopped)), file=sys.stderr)
    return bool(stopped)


def turn_report(out, stopped: bool) -> str:
    m = out.metrics
    disk = f" ({m.cached_prompt_tokens_disk} from disk)" if m.cached_prompt_tokens_disk else ""
    line = (f"[prefilled {m.prefill_tokens} new tokens, {m.cached_prompt_tokens} reused from the cache{disk}; "
            f"TTFT {m.ttft_s * 1000:.0f} ms; decode {m.decode_tok_s:.1f} tok/s; "
            f"KV cache {m.kv_cache_bytes / 2**20:.2f} MiB]")  # fmt: skip
    spec = m.spec_decoding
    if spec and spec["num_drafts"]:  # speculative decoding: this turn's acceptance
        line = line[:-1] + (f"; speculative α {spec['acceptance_rate']:.2f}, mean acceptance length "
                            f"{spec['mean_acceptance_length']:.2f}]")  # fmt: skip
    if stopped:
        return line + " (interrupted)"
    if out.finish_reason == "length":
        return line + " (length: /set max_tokens N for longer answers)"
    return line


def command(text: str, llm, convo: Conversation, args) -> bool:
    """Run a slash command; return whether the conversation was reset (a new session is needed)."""
    name, _, rest = text.partition(" ")
    rest = rest.strip()
    if name in ("/help", "/?"):
        print(HELP, file=sys.stderr)
    elif name in ("/clear", "/reset"):
        convo.turns.clear()
        print("(conversation cleared)", file=sys.stderr)
        return True
    elif name == "/show":
        print(show_settings(llm, convo, args), file=sys.stderr)
    elif name == "/set":
        return set_value(rest.removeprefix("parameter ").strip(), convo)
    else:
        print(f"unknown command '{name}': /help lists the commands", file=sys.stderr)
    return False


def set_value(text: str, convo: Conversation) -> bool:
    """`/set NAME VALUE`; return whether the conversation restarted (a new system message)."""
    key, _, value = text.partition(" ")
    value = value.strip()
    if key == "system":
        convo.system, convo.turns[:] = value or None, []
        print("(system message set; conversation cleared)", file=sys.stderr)
        return True
    if key not in SETTINGS or not value:
        print(f"usage: /set NAME VALUE, NAME one of {', '.join(SETTINGS)} or system", file=sys.stderr)
        return False
    try:
        convo.params = dataclasses.replace(convo.params, **{key: SETTINGS[key](value)})
    except ValueError:
        kind = "a whole number" if SETTINGS[key] is int else "a number"
        print(f"/set {key}: '{value}' is not {kind}", file=sys.stderr)
        return False
    except KvlabError as e:  # SamplingParams checked the value: out of range
        print(f"/set {key}: {e}", file=sys.stderr)
        return False
    print(f"({key} = {getattr(convo.params, key)})", file=sys.stderr)
    return False


def show_settings(llm, convo: Conversation, args) -> str:
    values = ", ".join(f"{key} {getattr(convo.params, key)}" for key in SETTINGS)
    return "\n".join([
        f"model    {args.model} ({llm.config.architecture}, {dtype_text(llm, args)} on {args.device}, "
        f"weights {llm.loaded.weight_format})",
        f"context  {llm.engine.max_model_len:,} tokens; this conversation: {len(convo.turns)} messages",
        f"system   {convo.system or '(none)'}",
        f"sampling {values}",
    ])  # fmt: skip


def line_editing():
    """Arrow keys, editing and history on a terminal (readline); return the function that saves the history."""
    if not sys.stdin.isatty():
        return lambda: None
    try:
        import readline
    except ImportError:  # Python built without it: plain input still works
        return lambda: None
    from kvlab.hub import kvlab_home

    path = kvlab_home() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    return save


def _line_buffer() -> str:
    """What was typed on the prompt line when Ctrl-C came ('' without readline)."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None and sys.stdin.isatty() else ""
