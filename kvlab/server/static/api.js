// The page talks to its own server like any client: same origin, JSON bodies, the API key when the
// server has one (entered once, kept for this tab in sessionStorage, sent as a Bearer token).

const KEY_SLOT = "kvlab-api-key";

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_SLOT) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_SLOT, key);
}

function headers(extra = {}) {
  const key = apiKey();
  return { ...(key ? { Authorization: `Bearer ${key}` } : {}), ...extra };
}

async function failure(response) {
  // The server's errors have OpenAI's shape; anything else (a proxy's page) is shown by status alone.
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  return new HttpError(response.status, message);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function getText(path) {
  const response = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!response.ok) throw await failure(response);
  return response.text();
}

// POST a JSON body and hand every server-sent event's parsed `data` to onEvent until `[DONE]`.
// Aborting `signal` closes the connection: the server aborts the request and frees its KV blocks.
export async function streamJSON(path, body, signal, onEvent) {
  const response = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) { // an event ends at a blank line
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// Prometheus' text format, as /metrics writes it: one sample a line, `name{labels} value`.
// Returns name -> [{labels, value}]; comments (# HELP, # TYPE) are skipped.
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)$/);
    if (!match) continue;
    const labels = {};
    for (const pair of (match[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    if (!samples.has(match[1])) samples.set(match[1], []);
    samples.get(match[1]).push({ labels, value: Number(match[4]) });
  }
  return samples;
}

// The first sample of a metric (the gauges and counters kvlab writes have one, labelled by model).
export function metric(samples, name) {
  const found = samples.get(name);
  return found && found.length ? found[0].value : NaN;
}
