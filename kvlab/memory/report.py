"""Text output of `kvlab mem`: the per-model table, the side-by-side comparison, --list and --pairs.

Binary units (KiB, MiB, GiB = 2^30 bytes) next to decimal ones (kB, MB, GB = 10^9 bytes), and the
exact byte count wherever there is room for it.
"""

from __future__ import annotations

from kvlab.memory.fit import MemoryReport
from kvlab.memory.kv import KindUsage
from kvlab.memory.pairs import pairs_steps, pairs_with_cache, pairs_without_cache
from kvlab.memory.units import fmt_bytes, fmt_count, fmt_gb


def table(rows: list[list[str]], left: int = 1, indent: str = "  ") -> str:
    """Align columns: the first `left` columns to the left, the others to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


def render(reports: list[MemoryReport]) -> str:
    """One model: a detailed table. Several: the totals side by side, then each breakdown."""
    if len(reports) == 1:
        return render_one(reports[0])
    parts = [render_side_by_side(reports)]
    for r in reports:
        parts.append(f"{r.name}: layers by kind\n{render_kinds(r.kinds)}")
    return "\n\n".join(parts)


def _heading(r: MemoryReport) -> str:
    q = r.query
    return (f"{r.name}  ({r.architecture}; {r.source})\n"
            f"  {q.context:,} tokens x {_seqs(q.batch)}, KV cache in {r.kv_dtype}, weights {r.weights_format}")


def render_kinds(kinds: tuple[KindUsage, ...]) -> str:
    """The per-layer-kind breakdown."""
    rows = [["layer kind", "layers", "numbers/token/layer", "window", "KV per token", "KV (batch)",
             "state (batch)"]]
    for k in kinds:
        rows.append([k.label, str(k.num_layers), f"{k.numbers_per_token:,}" if k.numbers_per_token else "-",
                     f"{k.window:,}" if k.window else "-",
                     fmt_bytes(k.bytes_per_token) if k.bytes_per_token else "-",
                     fmt_bytes(k.kv_bytes) if k.kv_bytes else "-",
                     fmt_bytes(k.state_bytes) if k.state_bytes else "-"])
    return table(rows)


def _quantities(r: MemoryReport) -> list[tuple[str, int | None]]:
    q = r.query
    rows: list[tuple[str, int | None]] = [("KV per token (growing layers)", r.kv_bytes_per_token)]
    if r.window_bytes_per_token:
        rows.append(("KV per token (sliding layers, until full)", r.window_bytes_per_token))
    rows.append((f"KV per sequence at {q.context:,} tokens", r.kv_bytes_per_sequence))
    if q.batch > 1:
        rows.append((f"KV for {q.batch:,} sequences", r.kv_bytes))
    if r.state_bytes:
        rows.append(("constant state per sequence", r.state_bytes_per_sequence))
        if q.batch > 1:
            rows.append((f"constant state for {q.batch:,} sequences", r.state_bytes))
    params = f", {fmt_count(r.params_total)} params" if r.params_total else ""
    rows.append((f"weights ({'exact, from the file' if r.weights_exact else 'counted'}{params})", r.weight_bytes))
    rows.append((f"workspace (prefill chunk of {q.prefill_chunk:,} + logits)", r.workspace_bytes))
    rows.append(("total", r.total_bytes))
    return rows


def render_one(r: MemoryReport) -> str:
    """A single model in detail: breakdown, totals in three units, fit and notes."""
    rows = [["", "bytes", "binary", "decimal"]]
    for label, value in _quantities(r):
        rows.append([label, "-" if value is None else f"{value:,}", fmt_bytes(value), fmt_gb(value)])
    lines = [_heading(r), "", render_kinds(r.kinds), "", table(rows)]
    if r.params_active and r.params_active != r.params_total:
        lines.append(f"  parameters: {fmt_count(r.params_total)} in total, {fmt_count(r.params_active)} "
                     "active per token")
        if r.weight_bytes:  # what a decode step of one sequence reads: the active share of the bytes
            per_token = r.weight_bytes * r.params_active // r.params_total
            lines.append(f"  weights read per token: about {fmt_bytes(per_token)} of {fmt_bytes(r.weight_bytes)} "
                         "(the active parameters' share)")
    if r.usable_bytes is not None:
        lines += ["", "  " + fit_sentence(r)]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


def fit_sentence(r: MemoryReport) -> str:
    """'80 GiB x 0.9 = 72 GiB usable: fits. At most ... '"""
    q = r.query
    head = f"device {fmt_bytes(q.device_bytes)} x {q.utilization:g} = {fmt_bytes(r.usable_bytes)} usable"
    if r.fits is None:
        return head + ": cannot tell (weights unknown)"
    verdict = "fits" if r.fits else "does NOT fit"
    if r.context_unbounded and r.max_context is None:
        ctx = "memory does not limit the context (no full-attention layers)"
    elif r.max_context:
        ctx = f"at most {r.max_context:,} tokens per sequence with {_seqs(q.batch)}"
    else:
        ctx = f"not even 1 token with {_seqs(q.batch)}"
    return (f"{head}: {verdict}. At most {r.max_batch:,} sequences of {q.context:,} tokens; {ctx}.")


def render_side_by_side(reports: list[MemoryReport]) -> str:
    """Several models as columns."""
    header = ["", *(r.name for r in reports)]
    rows = [header,
            ["architecture", *(r.architecture for r in reports)],
            ["layers", *(_kinds_short(r) for r in reports)],
            ["context x batch", *(f"{r.query.context:,} x {r.query.batch:,}" for r in reports)],
            ["KV dtype", *(r.kv_dtype for r in reports)],
            ["KV per token (growing)", *(fmt_bytes(r.kv_bytes_per_token) for r in reports)],
            ["KV per token (sliding)", *(_nonzero(r.window_bytes_per_token) for r in reports)],
            ["KV per sequence", *(fmt_bytes(r.kv_bytes_per_sequence) for r in reports)],
            ["KV for the batch", *(fmt_bytes(r.kv_bytes) for r in reports)],
            ["state for the batch", *(_nonzero(r.state_bytes) for r in reports)],
            ["params (total / active)", *(f"{fmt_count(r.params_total)} / {fmt_count(r.params_active)}"
                                          for r in reports)],
            ["weights", *(fmt_bytes(r.weight_bytes) for r in reports)],
            ["workspace", *(fmt_bytes(r.workspace_bytes) for r in reports)],
            ["total", *(fmt_bytes(r.total_bytes) for r in reports)],
            ["total (decimal)", *(fmt_gb(r.total_bytes) for r in reports)]]
    if any(r.usable_bytes is not None for r in reports):
        rows.append(["fits", *("-" if r.fits is None else "yes" if r.fits else "NO" for r in reports)])
        rows.append(["max sequences at context", *(_opt(r.max_batch) for r in reports)])
        rows.append(["max context at batch", *("unbounded" if r.context_unbounded and r.max_context is None
                                               else _opt(r.max_context) for r in reports)])
    out = table(rows)
    notes = [f"  note ({r.name}): {n}" for r in reports for n in r.notes]
    return "\n".join([out, "  binary units: GiB = 2^30 bytes; --json gives exact bytes", *notes])


def _seqs(n: int) -> str:
    return f"{n:,} sequence" + ("" if n == 1 else "s")


def _nonzero(n: int) -> str:
    return fmt_bytes(n) if n else "-"


def _kinds_short(r: MemoryReport) -> str:
    counts: dict[str, int] = {}
    for k in r.kinds:
        counts[k.label] = counts.get(k.label, 0) + k.num_layers
    return " + ".join(f"{n} {label}" for label, n in counts.items())


def _opt(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def render_pairs(n: int, m: int) -> str:
    """Seed 004's dependency counts, with the step-by-step rows when there are few steps."""
    with_cache, without = pairs_with_cache(n, m), pairs_without_cache(n, m)
    lines = [f"query-key pairs (one head, one layer) for a prompt of {n:,} and {m:,} new positions:",
             f"  with a KV cache:    {with_cache:,}   (n(n+1)/2 + mn + m(m+1)/2)",
             f"  without a cache:    {without:,}   (the whole prefix recomputed at every step)"]
    if with_cache:
        lines.append(f"  recomputation does {without / with_cache:,.2f}x the work")
    if m <= 16:
        rows = [["step", "positions", "pairs with cache", "pairs without"]]
        for i, (p, added, full) in enumerate(pairs_steps(n, m)):
            step = "prefill" if i == 0 and n else f"new {i if n else i + 1}"
            rows.append([step, f"{p:,}", f"{added:,}", f"{full:,}"])
        lines += ["", table(rows)]
    return "\n".join(lines)


def render_list(entries: list[dict]) -> str:
    """`kvlab mem --list`: the bundled configs."""
    rows = [["name", "architecture", "layers", "KV/token bf16", "sliding/token", "state/seq", "max context",
             "params"]]
    for e in entries:
        rows.append([e["name"], e["architecture"], e["layers"], fmt_bytes(e["kv_bytes_per_token"]),
                     fmt_bytes(e["window_bytes_per_token"]) if e["window_bytes_per_token"] else "-",
                     fmt_bytes(e["state_bytes"]) if e["state_bytes"] else "-",
                     _opt(e["max_context"]), fmt_count(e["params"])])
    return "bundled configs (kvlab/configs; use the name as MODEL):\n" + table(rows, left=3)
