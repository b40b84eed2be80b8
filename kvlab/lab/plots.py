"""The report's PNG plots, drawn from the JSON form of each experiment's results.

matplotlib is imported only here, on first use, with the Agg backend (no display needed). Error bars
span the fastest and slowest run of each point.
"""

from __future__ import annotations

from pathlib import Path

from kvlab.deps import require


def pyplot():
    require("matplotlib", "kvlab lab (its plots)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(name: str, data: dict, model: str, path: Path) -> None:
    plt = pyplot()
    fig = PLOTS[name](plt, data)
    fig.suptitle(f"kvlab lab {name} · {model}", fontsize=9, color="0.4")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_x(ax, xs: list[int]) -> None:
    """A log x axis labelled at exactly the measured sizes (1,000 rather than 10³)."""
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.minorticks_off()


def log_y(ax, label=None) -> None:
    """A log y axis with at least three labelled ticks, as plain numbers (5, 10, 15 rather than one lonely
    10¹ over a narrow range); `label` formats a tick's value (default: plain)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ticks = nice_log_ticks(lo, hi)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: (label or plain)(y)))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(lo, hi)


def nice_log_ticks(lo: float, hi: float) -> list[float]:
    """At least three ticks between lo and hi (both > 0), spread over the whole range: the plainest of
    1 × 10^k, 1-2-5, 1-1.5-2-3-5-7, every whole multiple or steps of 0.2 whose widest gap (on the log
    scale, the axis ends included) is at most half the range."""
    import math

    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    span = math.log10(hi / lo)
    ticks: list[float] = []
    fine = tuple(m / 5 for m in range(5, 50))  # 1, 1.2, 1.4, ...: a range narrower than a factor 2
    for steps in ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9), fine):
        ticks = [m * 10.0**k for k in decades for m in steps if lo <= m * 10.0**k <= hi]
        edges = [math.log10(t) for t in [lo, *ticks, hi]]
        if len(ticks) >= 3 and max(b - a for a, b in zip(edges, edges[1:])) <= span / 2:
            return ticks
    # a range narrower still (1,600 to 1,900): three ticks spread over it, at three significant digits
    spread = [lo * (hi / lo) ** (i / 4) for i in (1, 2, 3)]
    return [float(f"{t:.3g}") for t in spread]


def plain(x: float) -> str:
    """An axis number without exponents: 0.002, 0.5, 20, 1,000."""
    return f"{x:,.0f}" if x >= 1 and x == round(x) else f"{x:g}"


def rate_bars(points: list[dict], tokens_key: str | int, timing_key: str = "timing"):
    """(tok/s at the median, [below, above] error sizes) from each point's Timing."""
    mids, errs = [], [[], []]
    for p in points:
        n = p[tokens_key] if isinstance(tokens_key, str) else tokens_key
        t = p[timing_key]
        mid = n / t["median_s"]
        mids.append(mid)
        errs[0].append(mid - n / t["max_s"])
        errs[1].append(n / t["min_s"] - mid)
    return mids, errs


def time_bars(points: list[dict], timing_key: str = "timing", scale: float = 1e3):
    mids = [p[timing_key]["median_s"] * scale for p in points]
    errs = [[m - p[timing_key]["min_s"] * scale for m, p in zip(mids, points)],
            [p[timing_key]["max_s"] * scale - m for m, p in zip(mids, points)]]  # fmt: skip
    return mids, errs


def phases(plt, data):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [p["prompt_tokens"] for p in data["prefill"]]
    left.errorbar(xs, *rate_bars(data["prefill"], "prompt_tokens"), marker="o", capsize=3, label="kvlab")
    left.set(xlabel="prompt tokens", ylabel="prefill tok/s", title="Prefill: tokens per second")
    log_x(left, xs)
    xs_d = [d["context"] for d in data["decode"]]
    right.errorbar(xs_d, *rate_bars(data["decode"], "new_tokens"), marker="o", capsize=3, label="kvlab")
    right.set(xlabel="context (tokens)", ylabel="decode tok/s", title="Decode: tokens per second")
    log_x(right, xs_d)
    hf = data.get("transformers")
    if hf:
        left.plot(xs, [p["tok_s"] for p in hf["prefill"]], "s--", label="transformers")
        right.plot(xs_d, [p["tok_s"] for p in hf["decode"]], "s--", label="transformers")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        if hf:  # one series needs no legend
            ax.legend()
    return fig


def cache(plt, data):
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = data["points"]
    xs = [p["context"] for p in pts]
    ax.errorbar(xs, *rate_bars(pts, "cached_steps", "cached"), marker="o", capsize=3, label="with KV cache")
    ax.errorbar(xs, *rate_bars(pts, "uncached_steps", "uncached"), marker="s", capsize=3, label="without (recompute)")
    ax.set(xlabel="context (tokens)", ylabel="decode tokens per second (log scale)",
           title="Decode with and without the KV cache")
    log_x(ax, xs)
    log_y(ax)
    ax.legend()
    return fig


def roofline(plt, data):
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    bw = data["bandwidth"]["gb_s"] * 1e9
    peak = data["prefill"]["flop_s"]
    lo = min(data["decode"]["intensity"], data["ridge_intensity"], 1.0) / 4
    hi = max(data["prefill"]["intensity"], data["ridge_intensity"]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(bw * x, peak) for x in xs], color="0.3", label="roofline (measured bandwidth, prefill FLOP/s)")
    ax.axvline(data["ridge_intensity"], color="0.6", linestyle=":", label="ridge point")
    for p, marker in ((data["decode"], "o"), (data["prefill"], "s")):
        ax.plot(p["intensity"], p["flop_s"], marker, markersize=9, label=f"{p['name']} ({p['intensity']:.1f} FLOP/byte)")
    ax.set(xscale="log", xlabel="arithmetic intensity (FLOP per byte read, log scale)",
           ylabel="GFLOP/s (log scale)", title="Roofline: decode waits for memory, prefill for arithmetic")  # fmt: skip
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: plain(x)))
    log_y(ax, label=lambda y: plain(y / 1e9))
    ax.legend(fontsize=8)
    return fig


def dtype(plt, data):
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    names = [p["dtype"] for p in data["points"]]
    for ax, key, title in ((left, "decode_step", "one decode step"), (right, "prefill", "prefill")):
        mids, errs = time_bars(data["points"], key)
        ax.bar(names, mids, yerr=errs, capsize=4, color=["C0", "C1", "C2"])
        ax.set(ylabel="ms (median; bars: fastest to slowest run)", title=title)
    right.set_title(f"prefill of {data['points'][0]['prefill_tokens']} tokens")
    return fig


def bits(plt, data):
    """Decode tok/s against the bytes a decode step reads, with the bandwidth's prediction as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    pts = data["points"]
    xs = [p["bytes_per_token"] / 1e6 for p in pts]
    lo, hi = min(xs) * 0.7, max(xs) * 1.3
    line = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    bw = data["bandwidth_gb_s"]
    ax.plot(line, [bw * 1e3 / x for x in line], color="0.5", linestyle="--",
            label=f"prediction: {bw:.0f} GB/s ÷ bytes read")  # fmt: skip
    for p, x in zip(pts, xs):
        lo_s, hi_s = p["decode_step"]["min_s"], p["decode_step"]["max_s"]
        err = [[p["decode_tok_s"] - 1 / hi_s], [1 / lo_s - p["decode_tok_s"]]]
        ax.errorbar([x], [p["decode_tok_s"]], yerr=err, marker="o", capsize=3, linestyle="none")
        ax.annotate(p["label"], (x, p["decode_tok_s"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set(xscale="log", xlabel="bytes read per decode step (MB, log scale)",
           ylabel="decode tokens per second (log scale)", title="Fewer bytes per weight, faster decode")  # fmt: skip
    ax.set_xticks(xs, [f"{x:.0f}" for x in xs])
    ax.minorticks_off()
    log_y(ax)
    ax.legend(fontsize=8)
    return fig


def context(plt, data):
    fig, ax = plt.subplots(figsize=(6.5, 4))
    pts = data["points"]
    xs = [p["context"] for p in pts]
    ax.errorbar(xs, *time_bars(pts, "step"), marker="o", capsize=3, label="decode step (ms)")
    ax.set(xlabel="context (tokens in the KV cache)", ylabel="ms per decode step", title="One decode step against context")
    log_x(ax, xs)
    ax.set_ylim(bottom=0)
    kv = ax.twinx()
    kv.plot(xs, [p["kv_bytes_read"] / 1e6 for p in pts], "s--", color="C1", label="KV read per step (MB)")
    kv.set(ylabel="KV cache read per step (MB)")
    kv.set_ylim(bottom=0)
    # one legend for both axes, under the plot: inside it covered the title or the points
    handles = ax.get_legend_handles_labels()[0] + kv.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8, frameon=False)
    return fig


def attention(plt, data):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for backend, marker in (("sdpa", "o"), ("materialized", "s")):
        pts = [p for p in data["points"] if p[backend]]
        if not pts:
            continue
        xs = [p["prompt_tokens"] for p in pts]
        mids = [p[backend]["timing"]["median_s"] for p in pts]
        left.plot(xs, mids, marker=marker, label=backend)
        right.plot(xs, [p[backend]["peak_rss_delta_bytes"] / 1e6 for p in pts], marker=marker, label=backend)
    left.set(xlabel="prompt tokens", ylabel="prefill seconds (log scale)", title="Prefill time")
    right.set(xlabel="prompt tokens", ylabel="peak RSS above baseline (MB)", title="Peak memory")
    xs = [p["prompt_tokens"] for p in data["points"]]
    for ax in (left, right):
        log_x(ax, xs)
        ax.legend()
    log_y(left)
    return fig


def batching(plt, data):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    passes = data["passes"]
    xs = [p["tokens"] for p in passes]
    left.plot(xs, [p["ms_per_token"] for p in passes], "o-", label="N tokens of one prompt")
    steps = data.get("decode_steps") or []  # the serving engine's decode steps: B sequences, a token each
    if steps:
        left.plot([p["sequences"] for p in steps], [p["ms_per_token"] for p in steps], "s-",
                  label="engine decode step, N sequences")  # fmt: skip
        xs = sorted({*xs, *(p["sequences"] for p in steps)})
        left.legend(fontsize=8)
    left.set(xlabel="tokens in one forward pass", ylabel="ms per token", title="Cost per token of one pass")
    log_x(left, xs)
    left.set_ylim(bottom=0)
    seqs = data["sequences"]
    ns = [s["sequences"] for s in seqs]
    right.plot(ns, [s["together_tok_s"] for s in seqs], "o-", label="decoding together (one batch)")
    right.plot(ns, [s["one_at_a_time_tok_s"] for s in seqs], "s--", label="one at a time")
    right.set(xlabel="sequences", ylabel="tokens per second", title="N sequences decoding")
    log_x(right, ns)
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    return fig


def kv_dtype(plt, data):
    """Per KV format: bytes per token, decode speed at the long context, and KL divergence (log)."""
    pts = data["points"]
    names = [p["label"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2), sharey=True)
    ys = range(len(pts))
    colors = ["C2" if p["verdict"] == "ok" else "C1" if p["verdict"] == "caution" else "C3" for p in pts]
    axes[0].barh(ys, [p["bytes_per_token"] / 1e3 for p in pts], color="0.55")
    axes[0].set(xlabel="KV bytes per token (kB)", title="memory")
    axes[0].set_yticks(list(ys), names, fontsize=8)
    axes[0].invert_yaxis()
    mids = [p["decode_tok_s"] for p in pts]
    err = [[m - 1 / p["decode_step"]["max_s"] for m, p in zip(mids, pts)],
           [1 / p["decode_step"]["min_s"] - m for m, p in zip(mids, pts)]]  # fmt: skip
    axes[1].barh(ys, mids, xerr=err, capsize=3, color="C0")
    axes[1].set(xlabel="decode tokens per second", title=f"decode at {data['context']:,} tokens of context")
    axes[2].barh(ys, [max(p["mean_kld"], 1e-7) for p in pts], color=colors)
    axes[2].set(xscale="log", xlabel="mean KL divergence vs float32 KV (log)",
                title="quality (green ok, orange caution, red unsafe)")  # fmt: skip
    axes[2].axvline(0.005, color="0.4", linestyle="--", linewidth=0.8)
    return fig


def speculative(plt, data):
    """Measured (solid) and predicted (dashed) speedup over plain decoding against k, per proposer and workload."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {}
    for p in data["points"]:
        series.setdefault((p["proposer"], p["workload"]), []).append(p)
    for i, ((proposer, workload), points) in enumerate(sorted(series.items())):
        ks = [p["k"] for p in points]
        color = f"C{i}"
        left.plot(ks, [p["measured_speedup"] for p in points], "o-", color=color, label=f"{proposer}, {workload}")
        left.plot(ks, [p["predicted_speedup"] for p in points], "--", color=color, alpha=0.6)
        right.plot(ks, [p["alpha"] for p in points], "o-", color=color, label=f"{proposer}, {workload}")
    left.axhline(1.0, color="0.5", linewidth=0.8)
    left.set(xlabel="k (tokens drafted per step)", ylabel="speedup over plain decoding",
             title="Measured (solid) and predicted (dashed)")  # fmt: skip
    left.set_ylim(bottom=0)
    right.set(xlabel="k (tokens drafted per step)", ylabel="α (drafts accepted)", title="Acceptance rate")
    right.set_ylim(0, 1.05)
    if series:
        right.legend(fontsize=7)
    return fig


PLOTS = {"phases": phases, "cache": cache, "roofline": roofline, "dtype": dtype, "bits": bits, "context": context,
         "attention": attention, "batching": batching, "kv-dtype": kv_dtype, "speculative": speculative}  # fmt: skip


def long_context(plt, data):
    """Perplexity by position for each RoPE setting, the trained length marked."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    edges = data["edges"]
    mids = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]
    for s, marker in zip(data["series"], "osd^"):
        ax.plot(mids, s["ppl"], marker=marker, label=s["label"])
    ax.axvline(data["trained"], color="0.4", linestyle="--", linewidth=0.9,
               label=f"trained context ({data['trained']:,})")  # fmt: skip
    ax.set(xlabel="position of the predicted token", ylabel="perplexity (log scale)",
           title="Perplexity against position, inside and past the trained context")  # fmt: skip
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    log_y(ax)
    ax.legend(fontsize=8)
    return fig


def needle(plt, data):
    """Heat map of the share of needles found, by depth (rows) and context length (columns)."""
    cells = {(c["length"], c["depth"]): sum(a["correct"] for a in c["answers"]) / len(c["answers"]) for c in data["cells"]}
    lengths = [n for n in data["lengths"] if any((n, d) in cells for d in data["depths"])]
    depths = data["depths"]
    grid = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 + 1.3 * len(lengths)), 1.2 + 0.38 * len(depths)))
    if not lengths:
        ax.text(0.5, 0.5, "no context length fitted the model", ha="center", va="center")
        ax.set_axis_off()
        return fig
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
    ax.set(xlabel="context length (tokens)", ylabel="depth of the needle", title="Needles found")
    fig.colorbar(image, ax=ax, fraction=0.05, label="share found")
    return fig


PLOTS.update({"long-context": long_context, "needle": needle})


def moe(plt, data):
    """Decode tok/s against sequences per step, measured (solid) and predicted from bytes (dashed)."""

    def name(m: dict) -> str:
        s = m["shape"]
        return f"MoE {s['experts']}×{s['expert_size']}, top {s['top_k']}" if s["experts"] else f"dense, MLP {s['intermediate']:,}"

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for m, color in zip(data["models"], ("tab:orange", "tab:blue")):
        xs = [d["sequences"] for d in m["decode"]]
        ax.plot(xs, [d["tok_s"] for d in m["decode"]], "o-", color=color, label=f"{name(m)}: measured")
        ax.plot(xs, [d["predicted_tok_s"] for d in m["decode"]], "--", color=color, alpha=0.6,
                label=f"{name(m)}: bandwidth ÷ bytes")  # fmt: skip
    log_x(ax, [d["sequences"] for d in data["models"][0]["decode"]])
    ax.set_yscale("log")
    ax.set_xlabel("sequences per decode step")
    ax.set_ylabel("decode tok/s (all sequences)")
    ax.set_title("random blocks of real shapes: the values are noise", fontsize=8)
    ax.legend(fontsize=7)
    return fig


PLOTS["moe"] = moe
