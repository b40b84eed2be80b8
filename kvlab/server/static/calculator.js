// The memory calculator and the positions picture, both answered by one endpoint, /api/web/memory:
// `kvlab.memory` on the server computes every number (the object `kvlab mem --json` prints); this
// file only turns the sliders into a query and the answer into a table. Nothing here is arithmetic
// on a model's shape.

import { getJSON } from "./api.js";
import { bytes, count, el } from "./format.js";
import { drawPositions } from "./positions.js";

const GIB = 2 ** 30;

export class Calculator {
  constructor(model, onAuthError) {
    this.onAuthError = onAuthError;
    this.asked = 0; // the latest query's number: an older answer arriving late is dropped
    const config = document.getElementById("calc-config");
    config.replaceChildren(...model.configs.map((name) =>
      el("option", { value: name }, name === "served" ? `${model.model} (served)` : name)));
    const dtype = document.getElementById("calc-dtype");
    dtype.replaceChildren(...model.kv_dtypes.map((name) => el("option", { value: name }, name)));
    // "auto" is the served engine's own KV format for the served model, a config's dtype for the others
    this.autoOption = dtype.querySelector('option[value="auto"]');
    this.servedKvDtype = model.served_kv_dtype;
    const device = document.getElementById("calc-device");
    if (model.device_memory_bytes > 0) device.value = String(+(model.device_memory_bytes / GIB).toFixed(3));
    document.getElementById("calc-device").title = `${model.device}'s memory`;
    for (const id of ["calc-config", "calc-context", "calc-batch", "calc-dtype", "calc-device", "pos-n", "pos-m"]) {
      document.getElementById(id).addEventListener("input", () => this.update());
    }
  }

  // The sliders move in powers of two: contexts 128 … 1M tokens, 1 … 1,024 sequences.
  query() {
    const value = (id) => document.getElementById(id).value;
    const context = 2 ** Number(value("calc-context"));
    const batch = 2 ** Number(value("calc-batch"));
    show("calc-context-out", `${count(context)} tokens`);
    show("calc-batch-out", count(batch));
    show("pos-n-out", value("pos-n"));
    show("pos-m-out", value("pos-m"));
    const q = new URLSearchParams({ config: value("calc-config"), context, batch, kv_dtype: value("calc-dtype"),
                                    n: value("pos-n"), m: value("pos-m") });
    const gib = Number(value("calc-device"));
    if (gib > 0) q.set("device_bytes", String(Math.round(gib * GIB)));
    return q;
  }

  async update() {
    const asked = ++this.asked;
    this.autoOption.textContent = document.getElementById("calc-config").value === "served"
      ? `auto (what the server holds: ${this.servedKvDtype})` : "auto (the model's dtype)";
    const error = document.getElementById("calc-error");
    try {
      const answer = await getJSON(`/api/web/memory?${this.query()}`);
      if (asked !== this.asked) return;
      error.textContent = "";
      this.show(answer.models[0]);
      drawPositions(answer.pairs);
    } catch (e) {
      if (asked !== this.asked) return;
      error.textContent = e.message;
      if (e.status === 401) this.onAuthError();
    }
  }

  show(r) {
    const row = (label, value, id, note = "") => el("tr", {},
      el("th", { scope: "row" }, label),
      el("td", { id, dataset: value === null ? {} : { bytes: value }, title: value === null ? "" : `${count(value)} B` },
         bytes(value)),
      el("td", { class: "muted" }, note));
    const kinds = r.layer_kinds.map((k) => el("tr", { class: "kind" },
      el("th", { scope: "row" }, `${count(k.num_layers)} × ${k.label}`),
      el("td", { dataset: { bytes: k.kv_bytes + k.state_bytes }, title: `${count(k.kv_bytes + k.state_bytes)} B` },
         bytes(k.kv_bytes + k.state_bytes)),
      el("td", { class: "muted" }, k.bytes_per_token ? `${bytes(k.bytes_per_token)} a token` +
         (k.window ? `, window ${count(k.window)}` : "") : k.state_bytes ? "constant state" : "no cache")));
    const usable = r.usable_bytes === null ? [] : [
      row("usable device memory", r.usable_bytes, "calc-usable", `${Math.round(r.utilization * 100)}% of ${bytes(r.device_bytes)}`),
    ];
    const fit = r.fits === null ? "" : r.fits ? "fits" : "does not fit";
    const table = el("table", { class: "calc" },
      el("caption", {}, `${r.model}: ${count(r.batch)} × ${count(r.context)} tokens, KV in ${r.kv_dtype}`),
      el("tbody", {}, ...kinds,
         row("KV cache", r.kv_bytes, "calc-kv", `${bytes(r.kv_bytes_per_sequence)} a sequence`),
         r.state_bytes ? row("recurrent states", r.state_bytes, "calc-state") : null,
         row("weights", r.weight_bytes, "calc-weights", `${r.weights_format}${r.weights_exact ? "" : " (estimated)"}`),
         row("workspace", r.workspace_bytes, "calc-workspace", "activations and logits of one step"),
         row("total", r.total_bytes, "calc-total", fit),
         ...usable));
    const limits = r.max_batch === null ? [] : [
      el("p", { id: "calc-max-batch", dataset: { value: r.max_batch } },
         el("b", {}, "max concurrency: "), `${count(r.max_batch)} sequences of ${count(r.context)} tokens`),
      el("p", { id: "calc-max-context", dataset: { value: r.max_context ?? "unbounded" } },
         el("b", {}, "max context: "), r.max_context === null ? "not limited by memory"
           : `${count(r.max_context)} tokens for ${count(r.batch)} sequence${r.batch === 1 ? "" : "s"}`),
    ];
    const notes = r.notes.length ? el("ul", { class: "notes small" }, ...r.notes.map((n) => el("li", {}, n))) : null;
    document.getElementById("calc-result").replaceChildren(table, ...limits, notes ?? "");
    const result = document.getElementById("calc-result");
    Object.assign(result.dataset, { config: document.getElementById("calc-config").value, context: r.context,
                                    batch: r.batch, kvDtype: r.kv_dtype });
  }
}

function show(id, value) {
  document.getElementById(id).textContent = value;
}
