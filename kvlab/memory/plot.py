"""`kvlab mem --plot FILE.png`: KV cache (plus constant states) against context, one line per model.

matplotlib is imported here only, and only when a plot is asked for (pip install 'kvlab[lab]').
"""

from __future__ import annotations

from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.memory.kv import kv_bytes, state_bytes
from kvlab.config import ModelConfig
from kvlab.memory.units import GIB, fmt_bytes

MIN_CONTEXT = 128


def context_points(top: int, count: int = 64) -> list[int]:
    """About `count` token counts spaced evenly on a log axis from 128 to `top`, both included."""
    top = max(top, MIN_CONTEXT * 2)
    ratio = (top / MIN_CONTEXT) ** (1 / (count - 1))
    points = sorted({min(top, round(MIN_CONTEXT * ratio**i)) for i in range(count)} | {top})
    return points


def plot_kv(specs: list[ModelConfig], path: str | Path, *, batch: int = 1, kv_dtypes: list[str],
            top_context: int, device_bytes: int | None = None) -> Path:
    """Write a log-log PNG of KV + state bytes for `batch` sequences against context length."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise KvlabError("--plot needs matplotlib: pip install 'kvlab[lab]'") from None
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise KvlabError(f"--plot {path}: give a .png (or .svg, .pdf) file name")
    xs = context_points(top_context)
    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    beyond = False
    for spec, dtype in zip(specs, kv_dtypes):
        state = state_bytes(spec, batch)
        ys = [(kv_bytes(spec, x, batch, dtype) + state) / GIB for x in xs]
        label = f"{spec.name} ({dtype})" + (f", incl. {fmt_bytes(state)} state" if state else "")
        limit = spec.max_position_embeddings or xs[-1]
        inside = [(x, y) for x, y in zip(xs, ys) if x <= limit]
        (line,) = ax.plot(*zip(*inside), label=label, linewidth=1.8)
        outside = [(x, y) for x, y in zip(xs, ys) if x >= inside[-1][0]]
        if len(outside) > 1:  # past the trained context: dotted, same colour
            ax.plot(*zip(*outside), linestyle=":", linewidth=1.5, color=line.get_color())
            beyond = True
    if device_bytes:
        ax.axhline(device_bytes / GIB, color="black", linestyle="--", linewidth=1,
                   label=f"device memory {fmt_bytes(device_bytes)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel(f"KV cache + state for {batch:,} sequence{'s' if batch > 1 else ''} (GiB = 2^30 B)")
    ax.set_title("KV-cache memory against context" + (" (dotted: past the trained context)" if beyond else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise KvlabError(f"--plot {path}: cannot write it ({e.strerror or e})") from None
    return path
