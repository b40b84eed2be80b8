// Seed 004's picture: which query-key pairs each forward pass computes, for a prompt of n positions
// and m new ones. The passes and every count come from the server (kvlab.memory.pairs, through
// /api/web/memory's `pairs`); this file draws them. Row i is the query at position i, column j a key
// it may attend to (j <= i, causal).
//
//   with a cache     the prefill computes rows 1..n once; each later pass adds its one new row
//   without a cache  every pass recomputes all rows up to its last position: darker cells are
//                    computed more often, the number in a cell says how many times

import { count, el, svg } from "./format.js";

export function drawPositions(pairs) {
  const size = pairs.n + pairs.m;
  const cell = Math.max(6, Math.min(20, Math.floor(300 / size)));
  const passes = pairs.steps; // [{positions, with_cache, without_cache}], the prefill first
  const withCache = new Map(); // row -> the pass that computes it (its index)
  passes.forEach((pass, k) => {
    const first = k === 0 && pairs.n > 0 ? 1 : pass.positions;
    for (let row = first; row <= pass.positions; row += 1) withCache.set(row, k);
  });
  const timesWithout = (row) => passes.filter((pass) => pass.positions >= row).length;
  const most = passes.length;
  grid("pos-with", size, cell, (row) => ({
    class: withCache.get(row) === 0 && pairs.n > 0 ? "cell prompt" : "cell step",
    label: null,
  }));
  grid("pos-without", size, cell, (row) => {
    const times = timesWithout(row);
    return { class: "cell again", opacity: 0.25 + (0.75 * times) / most, label: cell >= 14 ? String(times) : null };
  });
  const sum = (key) => passes.map((p) => count(p[key])).join(" + ");
  document.getElementById("pos-with-caption").textContent =
    `with a cache: ${sum("with_cache")} = ${count(pairs.with_cache)} pairs`;
  document.getElementById("pos-without-caption").textContent =
    `without a cache: ${sum("without_cache")} = ${count(pairs.without_cache)} pairs`;
  const rows = passes.map((p, k) => el("tr", {},
    el("th", { scope: "row" }, k === 0 && pairs.n > 0 ? "prefill" : `new position ${p.positions}`),
    el("td", {}, count(p.positions)), el("td", {}, count(p.with_cache)), el("td", {}, count(p.without_cache))));
  const table = el("table", { class: "steps small", id: "pos-steps",
                              dataset: { withCache: pairs.with_cache, withoutCache: pairs.without_cache } },
    el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "pass"), el("th", { scope: "col" }, "positions"),
                       el("th", { scope: "col" }, "pairs with a cache"), el("th", { scope: "col" }, "pairs without"))),
    el("tbody", {}, ...rows),
    el("tfoot", {}, el("tr", {}, el("th", { scope: "row" }, "total"), el("td", {}, ""),
                       el("td", {}, count(pairs.with_cache)), el("td", {}, count(pairs.without_cache)))));
  const saved = pairs.without_cache > 0 ? pairs.with_cache / pairs.without_cache : 1;
  document.getElementById("pos-table").replaceChildren(table,
    el("p", { class: "small muted" }, `The cache computes ${(100 * saved).toFixed(0)}% of the pairs the ` +
       "recomputation does; what it stores instead is every position's K and V (the calculator above)."));
}

function grid(id, size, cell, style) {
  const picture = document.getElementById(id);
  const side = size * cell + 2;
  picture.setAttribute("viewBox", `0 0 ${side} ${side}`);
  picture.setAttribute("width", String(side));
  picture.setAttribute("height", String(side));
  const nodes = [];
  for (let row = 1; row <= size; row += 1) {
    const look = style(row);
    for (let col = 1; col <= row; col += 1) {
      const rect = svg("rect", { x: 1 + (col - 1) * cell, y: 1 + (row - 1) * cell, width: cell - 1, height: cell - 1,
                                 class: look.class });
      if (look.opacity !== undefined) rect.setAttribute("fill-opacity", look.opacity.toFixed(2));
      nodes.push(rect);
      if (look.label) {
        const text = svg("text", { x: 1 + (col - 0.5) * cell, y: 1 + (row - 0.5) * cell + 4, class: "cell-label" });
        text.textContent = look.label;
        nodes.push(text);
      }
    }
  }
  picture.replaceChildren(...nodes);
}
