// The chat: answers stream from the server's own API, and each one explains itself with the
// `kvlab` field of its last chunk (queue, prefill, decode, prefix-cache tokens, KV held).
//
//   chat mode  /v1/chat/completions: the whole conversation through the model's chat template
//   raw mode   /v1/completions: the text so far (prompts and continuations) as one prompt, for base models

import { streamJSON } from "./api.js";
import { bytes, count, el, rate, seconds } from "./format.js";

const END_SLACK_PX = 8; // this close to the pane's end counts as at the end (zoom gives fractional offsets)

const NOTES = {
  chat: "Each turn sends the whole conversation through the model's chat template; the turns before are " +
        "found in the prefix cache, so only the new tokens are prefilled.",
  raw: "Raw completion: the text so far — your prompts and the model's continuations — is one prompt to " +
       "/v1/completions, for base models without a chat template.",
};

export class Chat {
  constructor(model, onAnswer) {
    this.model = model; // /api/web/model's answer
    this.onAnswer = onAnswer; // called when an answer ends (the engine panel polls at once)
    this.list = document.getElementById("messages");
    this.prompt = document.getElementById("prompt");
    this.sendButton = document.getElementById("send");
    this.stopButton = document.getElementById("stop");
    this.controller = null;
    this.answers = []; // every answer's {node, kvlab} of this conversation, to scale the bars together
    this.reset();
    this.wire();
  }

  get mode() {
    return document.querySelector('input[name="mode"]:checked').value;
  }

  wire() {
    const chatRadio = document.querySelector('input[name="mode"][value="chat"]');
    if (!this.model.has_chat_template) { // a base model: raw completions only
      chatRadio.disabled = true;
      document.querySelector('input[name="mode"][value="raw"]').checked = true;
      chatRadio.parentElement.title = "this model has no chat template";
    }
    for (const radio of document.querySelectorAll('input[name="mode"]')) {
      radio.addEventListener("change", () => this.reset());
    }
    document.getElementById("clear").addEventListener("click", () => this.reset());
    document.getElementById("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      } else if (event.key === "Escape" && this.controller) {
        this.stop();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
  }

  reset() {
    if (this.controller) this.stop();
    this.history = []; // chat messages sent so far
    this.transcript = ""; // raw mode's text so far
    this.answers = [];
    this.list.replaceChildren();
    document.getElementById("mode-note").textContent = NOTES[this.mode];
  }

  params() {
    const number = (id) => document.getElementById(id).value.trim();
    const body = { temperature: Number(number("temperature") || 0), top_p: Number(number("top-p") || 1),
                   max_tokens: Math.max(1, Math.round(Number(number("max-tokens") || 64))) };
    if (number("seed") !== "") body.seed = Math.round(Number(number("seed")));
    const stops = document.getElementById("stop-strings").value.split("|").filter((s) => s.length > 0);
    if (stops.length) body.stop = stops;
    if (document.getElementById("ignore-eos").checked) body.ignore_eos = true;
    return body;
  }

  async send() {
    const text = this.prompt.value;
    if (this.controller || !text.trim()) return;
    const raw = this.mode === "raw";
    const path = raw ? "/v1/completions" : "/v1/chat/completions";
    const messages = [...this.history, { role: "user", content: text }];
    const body = { model: this.model.model, stream: true, ...this.params(),
                   ...(raw ? { prompt: this.transcript + text } : { messages }) };
    const answer = new Answer(raw ? "continuation" : "assistant");
    this.follow(() => this.list.append(
      el("li", { class: "message user" }, el("span", { class: "role" }, raw ? "prompt" : "you"),
         el("div", { class: "text" }, text)),
      answer.node), true); // a new question is always shown: the reader asked it
    this.prompt.value = "";
    this.busy(new AbortController());
    try {
      await streamJSON(path, body, this.controller.signal, (chunk) => this.follow(() => answer.chunk(chunk)));
      this.follow(() => answer.finish(this.controller.signal.aborted ? "stopped" : "done"));
    } catch (error) {
      if (this.controller.signal.aborted) this.follow(() => answer.finish("stopped"));
      else this.follow(() => answer.fail(error.message));
    }
    if (answer.status !== "error") { // the turn stays, even a stopped one: its K/V are in the prefix cache
      if (raw) this.transcript += text + answer.text;
      else this.history = [...messages, { role: "assistant", content: answer.text }];
    }
    if (answer.kvlab) this.answers.push(answer);
    this.follow(() => this.drawTimelines());
    this.busy(null);
    this.prompt.focus();
    this.onAnswer();
  }

  // The pane follows the conversation: a change made while it showed its end shows the new end (the
  // streaming text, its timings, the Stop note). A reader who scrolled up keeps their place; scrolling
  // back to the end follows again. Measured before each change, so no scroll event has to arrive first.
  follow(change, always = false) {
    const list = this.list;
    const atEnd = list.scrollHeight - list.scrollTop - list.clientHeight <= END_SLACK_PX;
    change();
    if (always || atEnd) list.scrollTop = list.scrollHeight;
  }

  stop() {
    if (this.controller) this.controller.abort(); // closes the stream: the server frees the request's blocks
  }

  busy(controller) {
    this.controller = controller;
    this.sendButton.disabled = controller !== null;
    this.stopButton.disabled = controller === null;
  }

  // Bars share one scale per conversation, so a turn that found its prompt in the cache is visibly shorter.
  drawTimelines() {
    const most = (key) => Math.max(1e-9, ...this.answers.map((a) => a.kvlab[key]));
    const scale = { ttft: most("ttft_s"), decode: most("decode_s"), prompt: most("prompt_tokens") };
    for (const answer of this.answers) answer.drawTimeline(scale);
  }
}

// One streamed answer: its text, a live line while it streams (this page's clock), then the
// server's own figures.
class Answer {
  constructor(role) {
    this.text = "";
    this.kvlab = null;
    this.status = "streaming";
    this.started = performance.now();
    this.firstText = null;
    this.pieces = 0;
    this.textNode = el("div", { class: "text" });
    this.live = el("p", { class: "live small muted" }, "waiting for the first token…");
    this.timeline = el("figure", { class: "timeline", "aria-label": "what this answer cost" });
    this.statusNode = el("span", { class: "status" }, "streaming");
    this.node = el("li", { class: "message answer", dataset: { status: "streaming" } },
                   el("span", { class: "role" }, role, " ", this.statusNode), this.textNode, this.live, this.timeline);
  }

  chunk(chunk) {
    if (chunk.kvlab) this.kvlab = chunk.kvlab;
    const choice = chunk.choices && chunk.choices[0];
    const piece = choice ? (choice.delta ? choice.delta.content : choice.text) : "";
    if (!piece) return;
    if (this.firstText === null) this.firstText = performance.now();
    this.pieces += 1;
    this.text += piece;
    this.textNode.textContent = this.text;
    const ttft = (this.firstText - this.started) / 1000;
    const elapsed = (performance.now() - this.started) / 1000;
    this.live.textContent = `streaming: first text after ${seconds(ttft)}, ${count(this.pieces)} pieces in ` +
      `${seconds(elapsed)} (this page's clock; the server's own figures follow the last token)`;
  }

  finish(status) {
    this.status = status;
    this.node.dataset.status = status;
    this.statusNode.textContent = status === "done" ? "" : status;
    if (this.kvlab) {
      this.live.remove();
      for (const key of ["ttft_s", "queue_s", "prefill_s", "decode_s", "cached_prompt_tokens", "prompt_tokens",
                         "generated_tokens", "kv_cache_bytes", "prefill_chunks"]) {
        this.node.dataset[key.replace(/_(\w)/g, (_, c) => c.toUpperCase())] = this.kvlab[key];
      }
    } else {
      this.live.textContent = status === "stopped"
        ? "stopped: the stream was closed, and the server freed the request's KV blocks"
        : "the server sent no timing";
    }
  }

  fail(message) {
    this.finish("error");
    this.statusNode.textContent = "error";
    this.live.textContent = message;
    this.live.className = "live small error";
  }

  drawTimeline(scale) {
    const k = this.kvlab;
    const width = (value, most) => (value > 0 ? `${Math.max(0.5, (100 * value) / most).toFixed(2)}%` : "0");
    const prefillTokS = k.prefill_s > 0 ? k.prefill_tokens / k.prefill_s : NaN;
    const decodeTokS = k.tpot_s > 0 ? 1 / k.tpot_s : NaN;
    const bar = (label, ...segments) => el("div", { class: "bar-row" }, el("span", { class: "bar-label" }, label),
                                           el("div", { class: "bar" }, ...segments));
    const seg = (cls, w, title) => el("span", { class: `seg ${cls}`, style: { width: w }, title });
    const chunks = `${count(k.prefill_chunks)} chunk${k.prefill_chunks === 1 ? "" : "s"}`;
    this.timeline.replaceChildren(
      bar("time to first token",
          seg("queue", width(k.queue_s, scale.ttft), `queue ${seconds(k.queue_s)}`),
          seg("prefill", width(k.prefill_s, scale.ttft), `prefill ${seconds(k.prefill_s)}`)),
      bar("prompt tokens",
          seg("cached", width(k.cached_prompt_tokens, scale.prompt), `${count(k.cached_prompt_tokens)} from the prefix cache`),
          seg("computed", width(k.prefill_tokens, scale.prompt), `${count(k.prefill_tokens)} prefilled`)),
      bar("decode",
          seg("decode", width(k.decode_s, scale.decode), `decode ${seconds(k.decode_s)}`)),
      el("figcaption", { class: "small" },
         fact("queue", seconds(k.queue_s)), fact("TTFT", seconds(k.ttft_s)),
         fact("prefill", `${count(k.prefill_tokens)} tokens, ${chunks}, ${rate(prefillTokS)}`),
         fact("decode", `${count(k.generated_tokens)} tokens, ${rate(decodeTokS)}` +
                        (k.mean_decode_batch > 1 ? ` in batches of ${k.mean_decode_batch.toFixed(1)}` : "")),
         fact("from the prefix cache", `${count(k.cached_prompt_tokens)} of ${count(k.prompt_tokens)} prompt tokens`,
              "cached"),
         fact("KV held", `${bytes(k.kv_cache_bytes)} in ${count(k.kv_blocks)} blocks`),
         k.num_preemptions ? fact("preempted", `${count(k.num_preemptions)}×`) : null),
    );
  }
}

function fact(name, value, cls = "") {
  return el("span", { class: `fact ${cls}` }, el("b", {}, name), " ", value);
}
