// The engine, live, from /metrics (the Prometheus text every scraper reads; with the API key unless
// the server runs with --public-metrics): requests running and waiting, the KV pool's blocks, the
// prefix-cache hit rate, and tokens per second over the last minute from the counters' differences.

import { getText, metric, parseMetrics } from "./api.js";
import { bytes, count, percent, rate, svg } from "./format.js";

const POLL_MS = 1000;
const WINDOW_S = 60;

export class EnginePanel {
  constructor(onAuthError) {
    this.onAuthError = onAuthError;
    this.history = []; // {t, generated, through} per poll: seconds, tokens per second
    this.last = null; // the previous poll's counters, for the rates
    this.timer = null;
    this.polling = false;
  }

  start() {
    if (this.timer === null) this.timer = setInterval(() => this.poll(), POLL_MS);
    this.poll();
  }

  async poll() {
    if (this.polling) return; // a slow answer must not pile polls up
    this.polling = true;
    const error = document.getElementById("engine-error");
    try {
      const samples = parseMetrics(await getText("/metrics"));
      error.textContent = "";
      this.show(samples, performance.now() / 1000);
    } catch (e) {
      error.textContent = `/metrics: ${e.message}`;
      if (e.status === 401) this.onAuthError();
    } finally {
      this.polling = false;
    }
  }

  show(samples, now) {
    const value = (name) => metric(samples, name);
    const total = value("kvlab_kv_blocks_total");
    const used = value("kvlab_kv_blocks_used");
    const cached = value("kvlab_kv_blocks_cached");
    const running = value("kvlab_requests_running");
    text("running", count(running));
    text("waiting", count(value("kvlab_requests_waiting")));
    text("preemptions", count(value("kvlab_preemptions_total")));
    const queries = value("kvlab_prefix_cache_queries_total");
    text("hit-rate", queries > 0
      ? `${percent(value("kvlab_prefix_cache_hit_rate"))} (${count(value("kvlab_prefix_cache_hits_total"))} of ${count(queries)} tokens)`
      : "no prompt yet");
    this.showDiskTier(value);
    const gauge = document.getElementById("pool-gauge");
    const free = total - used - cached;
    const share = (blocks) => (blocks > 0 ? Math.max(0.6, (100 * blocks) / total) : 0); // a held block stays visible
    gauge.querySelector(".used").style.width = `${share(used)}%`;
    gauge.querySelector(".cached").style.width = `${share(cached)}%`;
    gauge.setAttribute("aria-valuenow", String(used / total));
    gauge.setAttribute("aria-valuetext", `${used} of ${total} blocks used, ${cached} cached, ${free} free`);
    Object.assign(gauge.dataset, { used, cached, free, total, running, idle: String(used === 0 && running === 0) });
    text("pool-text", `${count(used)} used, ${count(cached)} cached, ${count(free)} free of ${count(total)} blocks` +
      (used === 0 && running === 0 ? " (idle)" : ""));
    this.record(now, value("kvlab_generation_tokens_total"), value("kvlab_engine_step_tokens_total"));
  }

  // the prefix cache's second tier (--prompt-cache-dir): shown only when the server has one
  showDiskTier(value) {
    const held = value("kvlab_prompt_cache_disk_bytes");
    document.getElementById("disk-tier-row").hidden = !Number.isFinite(held);
    if (!Number.isFinite(held)) return;
    const writable = value("kvlab_prompt_cache_disk_writable") === 1 ? "" : ", not writing (disk full or read-only)";
    text("disk-tier", `${bytes(held)} of ${bytes(value("kvlab_prompt_cache_disk_max_bytes"))}; ` +
      `${count(value("kvlab_prompt_cache_disk_hits_total"))} blocks read, ` +
      `${count(value("kvlab_prompt_cache_disk_tokens_total"))} prompt tokens from disk, ` +
      `${count(value("kvlab_prompt_cache_disk_evictions_total"))} evicted${writable}`);
  }

  record(now, generated, through) {
    if (this.last) {
      const dt = now - this.last.t;
      // a counter that went down means the server restarted: start the rates again
      if (dt > 0 && generated >= this.last.generated && through >= this.last.through) {
        this.history.push({ t: now, generated: (generated - this.last.generated) / dt,
                            through: (through - this.last.through) / dt });
      }
    }
    this.last = { t: now, generated, through };
    this.history = this.history.filter((p) => now - p.t <= WINDOW_S);
    const latest = this.history[this.history.length - 1];
    text("rate-now", latest ? `${rate(latest.generated)} generated, ${rate(latest.through)} through the model`
                            : "measuring…");
    this.draw(now);
  }

  draw(now) {
    const chart = document.getElementById("rate-chart");
    const [w, h, pad] = [300, 90, 12];
    const top = Math.max(1, ...this.history.map((p) => p.through));
    const x = (t) => w - ((now - t) / WINDOW_S) * w;
    const y = (v) => h - (v / top) * (h - pad);
    const line = (key, cls) => svg("polyline", {
      class: cls, fill: "none", points: this.history.map((p) => `${x(p.t).toFixed(1)},${y(p[key]).toFixed(1)}`).join(" "),
    });
    const label = svg("text", { x: 2, y: 10, class: "axis" });
    label.textContent = `${Math.round(top)} tok/s`;
    const ago = svg("text", { x: 2, y: h - 2, class: "axis" });
    ago.textContent = `${WINDOW_S} s ago`;
    const nowLabel = svg("text", { x: w - 2, y: h - 2, class: "axis end" });
    nowLabel.textContent = "now";
    chart.replaceChildren(svg("line", { x1: 0, y1: pad, x2: w, y2: pad, class: "grid" }),
                          line("through", "all"), line("generated", "gen"), label, ago, nowLabel);
  }
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}
