// How numbers read on the page: binary byte units (GiB = 2^30 B, as `kvlab mem` prints them),
// exact counts with thousands separators, times in ms below a second.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

export function bytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "–";
  let i = 0;
  let v = n;
  while (Math.abs(v) >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i += 1;
  }
  const digits = i === 0 ? 0 : v >= 100 ? 1 : v >= 10 ? 2 : 3;
  return `${Number(v.toFixed(digits)).toLocaleString("en-US")} ${UNITS[i]}`;
}

export function count(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "–";
  return Math.round(n).toLocaleString("en-US");
}

export function seconds(s) {
  if (!Number.isFinite(s)) return "–";
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : s < 0.1 ? 1 : 0)} ms`;
  return `${s.toFixed(2)} s`;
}

export function rate(tokensPerSecond) {
  if (!Number.isFinite(tokensPerSecond) || tokensPerSecond < 0) return "–";
  return `${tokensPerSecond.toFixed(tokensPerSecond >= 100 ? 0 : 1)} tok/s`;
}

export function percent(share) {
  return Number.isFinite(share) ? `${(share * 100).toFixed(1)}%` : "–";
}

// A tiny element builder: el("span", {class: "x", dataset: {k: 1}}, "text", child, ...).
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "style") Object.assign(node.style, value); // CSSOM: the page's CSP refuses style attributes
    else if (name === "class") node.className = value;
    else if (value !== false && value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

export const SVG_NS = "http://www.w3.org/2000/svg";

export function svg(tag, attributes = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}
